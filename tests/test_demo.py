"""The demo: its streaming engine against the library, its API through gradio_client, stop, and load."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import pytest
import torch

from decodekit import Strategy, encode_prompts, generate_text
from decodekit.demo import app as demo_app
from decodekit.demo.app import candidates_plot, launch
from decodekit.demo.engine import GENERATION_THREAD, stream
from decodekit.fields import BY_NAME, Field


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


def _client(url, **kwargs):
    from gradio_client import Client

    return Client(url, verbose=False, **kwargs)


def _text(result) -> str:
    return "".join(token for token, _ in result["tokens"])


@pytest.mark.parametrize(
    ("preset", "settings", "strategy"),
    [
        ("greedy", None, Strategy()),
        ("greedy", {"min_p": 0.1, "temperature": 0.7}, Strategy(min_p=0.1, temperature=0.7)),
        ("greedy", {"num_beams": 3}, Strategy(num_beams=3)),
        ("staged penalty", {}, Strategy(staged_penalty="1:1.2,3:1.5,6:2.0", penalty_window=64)),
        ("greedy", {"kv_memory_fraction": 0.5, "kv_bits": "8"}, Strategy(kv_memory_fraction=0.5, kv_bits=8)),
        (
            "greedy",
            {"kv_budget": 40, "kv_scoring": "reconstruction"},
            Strategy(kv_budget=40, kv_scoring="reconstruction"),
        ),
    ],
)
def test_the_api_takes_named_settings_and_streams_the_librarys_text(served, preset, settings, strategy):
    url, model, tokenizer = served
    client = _client(url)
    if strategy.sampling:  # sampling: compare what the API reports with the recipe it was given
        result = client.predict(prompt="Hello there", max_new_tokens=12, preset=preset, settings=settings,
                                api_name="/generate")  # fmt: skip
        assert result["done"] and result["stats"]["new tokens"] == 12
        return
    result = client.predict(
        prompt="Hello there", max_new_tokens=12, preset=preset, settings=settings, api_name="/generate"
    )
    expected = generate_text(model, tokenizer, ["Hello there"], strategy, max_new_tokens=12)[0]
    assert result["done"] and result["text"] == expected
    if not strategy.beam:
        assert _text(result) == expected
        assert {"tokens/s", "time to first token (s)", "full KV cache (KiB)"} <= set(result["stats"])
    if strategy.compresses_cache:
        assert "compressed KV cache (KiB)" in result["stats"]


def test_the_api_is_stable_when_a_field_is_added(tiny, monkeypatch):
    """A field added to the table (here before every other one, which shifts every positional control)
    leaves the API's named parameters as they were."""
    model, tokenizer = tiny
    added = Field("added_knob", "real", "sampling", "a new sampler's knob", 0, 1)
    monkeypatch.setitem(BY_NAME, "added_knob", added)
    monkeypatch.setattr(demo_app, "CONTROLS", ("added_knob", *demo_app.CONTROLS))
    port = _free_port()
    app = launch(model, tokenizer, port=port, block=False)
    try:
        client = _client(f"http://127.0.0.1:{port}/")
        for settings, strategy in [(None, Strategy()), ({"num_beams": 2}, Strategy(num_beams=2))]:
            result = client.predict(prompt="Hi", max_new_tokens=6, settings=settings, api_name="/generate")
            assert result["text"] == generate_text(model, tokenizer, ["Hi"], strategy, max_new_tokens=6)[0]
        sampled = client.predict(prompt="Hi", max_new_tokens=6, preset="min-p 0.1, T=1.0", api_name="/generate")
        assert sampled["done"] and sampled["stats"]["new tokens"] == 6
    finally:
        app.close()


@pytest.mark.parametrize(
    ("prompt", "settings", "message"),
    [
        ("", None, "Type a prompt first"),
        ("Hi", {"temperature": -1}, r"temperature must be a number in \[1e-06, 10000\]"),
        ("Hi", {"temprature": 0.5}, "unknown setting 'temprature'; the settings are: temperature, top_k"),
        ("Hi", [0.5], "settings must map field names to values"),
    ],
)
def test_bad_settings_show_a_message_and_the_app_keeps_serving(served, prompt, settings, message):
    from gradio_client.exceptions import AppError

    url, _, _ = served
    client = _client(url)
    with pytest.raises(AppError, match=message):
        client.predict(prompt=prompt, max_new_tokens=4, preset="top-p 0.9, T=0.8", settings=settings,
                       api_name="/generate")  # fmt: skip
    assert client.predict(prompt="Hi", max_new_tokens=2, api_name="/generate")["stats"]["new tokens"] == 2


@pytest.fixture
def slow_served(tiny):
    """The demo on a copy of the tiny model slowed to at least 20 ms a step, so a 512-token run lasts 10 s or more."""
    from tests.tiny import build_model

    _, tokenizer = tiny
    model = build_model(tokenizer)
    model.register_forward_pre_hook(lambda module, args: time.sleep(0.02))
    port = _free_port()
    app = launch(model, tokenizer, port=port, block=False)
    yield f"http://127.0.0.1:{port}/", app.demo_session
    app.close()


def _wait_for(condition, seconds: float = 60.0) -> bool:
    """Poll ``condition`` until it holds; a generous bound that only a hung server reaches."""
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.02)
    return condition()


def test_stop_ends_the_visitors_own_run_through_the_apps_switch(slow_served):
    """Two visitors generate; A's Stop finds A's run under A's session (the switch itself, not Gradio's
    cancellation: the API's stop cancels nothing) and ends it, while B's run goes on."""
    url, session = slow_served
    visitor_a, visitor_b = _client(url), _client(url)
    job_a = visitor_a.submit(prompt="Tell me a story", max_new_tokens=512, api_name="/generate")
    job_b = visitor_b.submit(prompt="Tell me a poem", max_new_tokens=512, api_name="/generate")
    both = {visitor_a.session_hash: 1, visitor_b.session_hash: 1}
    assert _wait_for(lambda: session.sessions() == both), session.sessions()
    assert visitor_a.predict(api_name="/stop") == 1  # the stop handler found A's run
    assert _wait_for(job_a.done)
    final = job_a.result()
    assert final["done"] and final["stats"]["new tokens"] < 512  # ended early, with what it had generated
    assert session.sessions() == {visitor_b.session_hash: 1} and not job_b.done()  # B goes on
    assert visitor_b.predict(api_name="/stop") == 1
    assert _wait_for(job_b.done) and job_b.result()["stats"]["new tokens"] < 512
    assert _wait_for(lambda: not _generating())  # no generation thread is left behind
    assert visitor_a.predict(api_name="/stop") == 0  # nothing left to stop


def test_a_set_stop_switch_ends_the_generation_within_a_step(tiny):
    """The engine checks the switch after every step: set while step 3 is computed, three tokens come out."""
    from transformers import LogitsProcessor

    model, tokenizer = tiny
    stop = threading.Event()

    class StopAtThirdStep(LogitsProcessor):
        calls = 0

        def __call__(self, input_ids, scores):
            StopAtThirdStep.calls += 1
            if StopAtThirdStep.calls == 3:
                stop.set()
            return scores

    original = Strategy.plan

    def plan_with_stopper(self, *args, **kwargs):
        plan = original(self, *args, **kwargs)
        return dataclasses.replace(plan, processors=[*plan.processors, StopAtThirdStep()])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Strategy, "plan", plan_with_stopper)
        final = list(stream(model, tokenizer, "Tell me a story", Strategy(), max_new_tokens=100, stop=stop))[-1]
    assert final.done and final.stats.new_tokens == 3


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
                client.predict(prompt=f"Request {index}", max_new_tokens=6, preset=preset, api_name="/generate")
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


def test_an_auth_file_gives_the_accounts_and_names_a_bad_line_without_echoing_it(tmp_path):
    from decodekit.demo.access import read_auth_file

    good = tmp_path / "users.txt"
    good.write_text("# accounts\nada: pass:word \n\n  bob:hunter2\n", encoding="utf-8")
    assert read_auth_file(good) == [("ada", " pass:word"), ("bob", "hunter2")]
    bad = tmp_path / "bad.txt"
    bad.write_text("ada:fine\nsecretwithoutcolon\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2: expected user:password") as raised:
        read_auth_file(bad)
    assert "secretwithoutcolon" not in str(raised.value)
    for text, message in [(":nouser\n", "line 1"), ("nopassword:\n", "line 1"), ("# only\n", "no user:password")]:
        bad.write_text(text, encoding="utf-8")
        with pytest.raises(ValueError, match=message):
            read_auth_file(bad)
    with pytest.raises(ValueError, match="cannot be read"):
        read_auth_file(tmp_path / "missing.txt")


def test_with_accounts_the_demo_asks_for_a_sign_in(tiny, capsys):
    from gradio_client import Client
    from gradio_client.exceptions import AuthenticationError

    model, tokenizer = tiny
    port = _free_port()
    app = launch(model, tokenizer, port=port, block=False, auth=[("ada", "s3cret")])
    try:
        assert "sign-in required (1 account)" in capsys.readouterr().out
        url = f"http://127.0.0.1:{port}/"
        with pytest.raises(ValueError, match="Could not login"):
            Client(url, verbose=False, auth=("ada", "wrong"))
        with pytest.raises(AuthenticationError, match="credentials were not provided"):
            Client(url, verbose=False)
        signed_in = Client(url, verbose=False, auth=("ada", "s3cret"))
        assert signed_in.predict(prompt="Hi", max_new_tokens=2, api_name="/generate")["stats"]["new tokens"] == 2
    finally:
        app.close()


@pytest.mark.parametrize(
    ("host", "accounts", "note"),
    [
        ("127.0.0.1", 0, None),
        ("localhost", 0, None),
        ("::1", 0, None),
        ("0.0.0.0", 0, "open to anyone who can reach this port (no --auth-file)"),
        ("192.168.1.5", 0, "open to anyone"),
        ("demo.example", 0, "open to anyone"),
        ("0.0.0.0", 2, "sign-in required (2 accounts)"),
    ],
)
def test_the_start_message_says_when_the_demo_is_open_beyond_this_machine(host, accounts, note):
    from decodekit.demo.app import start_message

    message = start_message(host, 7860, accounts)
    assert message.startswith(f"decodekit demo: serving on http://{host}:7860")
    if note is None:
        assert "open to anyone" not in message and "sign-in" not in message
    else:
        assert note in message


def test_the_readmes_client_example_runs_against_the_demo(served):
    """The README's gradio_client block, pointed at this server, runs and prints what it says."""
    import contextlib
    import io
    import re
    from pathlib import Path

    url, _, _ = served
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (block,) = [code for code in re.findall(r"```py\n(.*?)```", readme, re.S) if "gradio_client" in code]
    assert 'Client("http://127.0.0.1:7860/")' in block
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block.replace("http://127.0.0.1:7860/", url), "README client example", "exec"), {})
    first, stopped = printed.getvalue().splitlines()[-2:]
    assert float(first.split()[-1]) > 0  # the text, then its tokens/s
    assert stopped in ("0", "1")
