"""The demo: its streaming engine against the library, its API through gradio_client, stop, and load."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from decodekit import Strategy, encode_prompts, generate_text
from decodekit.demo.app import candidates_plot, launch, unset_controls
from decodekit.demo.engine import GENERATION_THREAD, stream

CONTROLS_UNSET = unset_controls()


def test_the_stream_ends_with_the_librarys_text_and_the_models_probabilities(tiny):
    model, tokenizer = tiny
    updates = list(stream(model, tokenizer, "Hello there", Strategy(), max_new_tokens=10))
    final = updates[-1]
    assert final.done and not any(update.done for update in updates[:-1])
    assert final.text == generate_text(model, tokenizer, ["Hello there"], Strategy(), max_new_tokens=10)[0]
    batch = encode_prompts(tokenizer, ["Hello there"])
    prompt_length = batch["input_ids"].shape[1]
    new_ids = model.generate(**batch, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id)[0]
    with torch.no_grad():  # greedy has no processors: the shade is the model's own probability
        logits = model(new_ids[None]).logits[0, prompt_length - 1 : -1]
    expected = torch.softmax(logits, -1)[torch.arange(len(new_ids) - prompt_length), new_ids[prompt_length:]]
    assert [p for _, p in final.tokens] == pytest.approx(expected.tolist(), rel=1e-4)
    assert len(final.candidates) == 10 and final.stats.new_tokens == 10


def test_candidates_show_what_min_p_removed(tiny):
    model, tokenizer = tiny
    final = list(stream(model, tokenizer, "Hello", Strategy(temperature=1.0, min_p=0.3), max_new_tokens=4))[-1]
    step = final.candidates[0]
    assert step["before"] == sorted(step["before"], reverse=True)
    assert any(after == 0.0 for after in step["after"])  # filtered out by min-p
    assert all(
        after > 0
        for before, after in zip(step["before"], step["after"], strict=True)
        if before >= 0.3 * step["before"][0]
    )
    table = candidates_plot(final.candidates, 1)
    assert set(table["stage"]) == {"before processors", "after processors"} and len(table) == 16


def test_a_compressed_cache_and_beam_search_report_their_stats(tiny):
    model, tokenizer = tiny
    cached = list(stream(model, tokenizer, "Hello " * 30, Strategy(kv_budget=40), max_new_tokens=12))[-1]
    assert cached.stats.compressed_cache_bytes < cached.stats.full_cache_bytes
    beams = list(stream(model, tokenizer, "Hello", Strategy(num_beams=3), max_new_tokens=6))
    steps = [update.stats.steps for update in beams[:-1]]
    assert steps == sorted(steps) and steps[-1] == 6 and len(steps) == 6  # one update per step
    assert all(update.stats.best_score is not None for update in beams[:-1])
    assert beams[-1].text == generate_text(model, tokenizer, ["Hello"], Strategy(num_beams=3), max_new_tokens=6)[0]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny):
    model, tokenizer = tiny
    port = _free_port()
    app = launch(model, tokenizer, port=port, block=False)
    yield f"http://127.0.0.1:{port}/", model, tokenizer
    app.close()


def _client(url):
    from gradio_client import Client

    return Client(url, verbose=False)


def test_the_api_streams_the_same_text_as_the_library(served):
    url, model, tokenizer = served
    shaded, stats, _ = _client(url).predict("Hello there", 12, "greedy", *CONTROLS_UNSET, api_name="/run_a")
    expected = generate_text(model, tokenizer, ["Hello there"], Strategy(), max_new_tokens=12)[0]
    assert "".join(part["token"] for part in shaded) == expected
    assert {"tokens/s", "time to first token (s)", "full KV cache (KiB)"} <= set(stats)


@pytest.mark.parametrize(
    ("prompt", "temperature", "message"),
    [("", 0, "Type a prompt first"), ("Hi", -1, r"temperature must be a number in \[1e-06, 10000\]")],
)
def test_bad_settings_show_a_message_and_the_app_keeps_serving(served, prompt, temperature, message):
    from gradio_client.exceptions import AppError

    url, _, _ = served
    client = _client(url)
    controls = [temperature, *CONTROLS_UNSET[1:]]
    with pytest.raises(AppError, match=message):
        client.predict(prompt, 4, "top-p 0.9, T=0.8", *controls, api_name="/run_b")
    assert client.predict("Hi", 2, "greedy", *CONTROLS_UNSET, api_name="/run_b")[1]["new tokens"] == 2


def test_stop_ends_the_generation_thread(served):
    url, _, _ = served
    client = _client(url)
    job = client.submit("Tell me a story", 512, "greedy", *CONTROLS_UNSET, api_name="/run_a")
    deadline = time.time() + 30
    while not _generating() and time.time() < deadline:
        time.sleep(0.05)
    assert _generating()
    client.predict(api_name="/stop")
    stopped_by = time.time() + 1.0  # 512 tokens would take several more seconds
    while _generating() and time.time() < stopped_by:
        time.sleep(0.02)
    assert not _generating()  # the generate thread itself has ended, not just the display
    while not job.done() and time.time() < deadline:
        time.sleep(0.05)
    assert job.done()


def _generating() -> bool:
    return any(thread.name == GENERATION_THREAD for thread in threading.enumerate())


def test_eight_clients_each_complete_several_requests(served):
    url, _, _ = served
    errors, finished = [], []

    def user(index):
        try:
            client = _client(url)
            for _ in range(3):
                preset = ["greedy", "min-p 0.1, T=1.0"][index % 2]
                client.predict(f"Request {index}", 6, preset, *CONTROLS_UNSET, api_name="/run_a")
                finished.append(index)
        except Exception as error:
            errors.append(error)

    users = [threading.Thread(target=user, args=(index,)) for index in range(8)]
    for thread in users:
        thread.start()
    for thread in users:
        thread.join(timeout=300)
    assert not errors
    assert len(finished) == 24
