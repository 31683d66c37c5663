"""Reliability: the demo under concurrent use and disconnects, and a clear message for every bad input.

One test per case found by a load and fault harness; each failed before its fix.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from decodekit import (
    CompressedCache,
    FrequencyPresencePenaltyLogitsProcessor,
    GumbelSamplingLogitsProcessor,
    MinPLogitsProcessor,
    StagedRepetitionPenaltyLogitsProcessor,
    Strategy,
    generate_text,
)
from decodekit import models as models_module
from decodekit.cache.options import SizeOptions
from decodekit.cli import main
from decodekit.decoders import LengthNormalization, beam_search
from decodekit.demo.engine import GENERATION_THREAD, stream
from decodekit.eval import reports as reports_module
from decodekit.eval import runner as runner_module
from decodekit.eval.data_sources import DataFileError, load_prompts
from decodekit.eval.runner import EvaluationReport, evaluate_strategies

gradio = pytest.importorskip("gradio")
from decodekit.demo.app import (  # noqa: E402
    DemoLimits,
    DemoSession,
    format_stats,
    launch,
    strategy_from_controls,
)


def _generation_threads() -> int:
    return sum(thread.name == GENERATION_THREAD for thread in threading.enumerate())


def _wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture
def slow_tiny(fresh_tiny):
    """The tiny model slowed to about 20 ms per forward pass, so a long generation takes seconds."""
    model, tokenizer = fresh_tiny
    handle = model.register_forward_hook(lambda module, args, output: time.sleep(0.02))
    yield model, tokenizer
    handle.remove()


# 1. The demo's stats never read the cache from another thread.
def test_the_ui_thread_never_reads_the_cache_mid_update(fresh_tiny, monkeypatch):
    model, tokenizer = fresh_tiny
    readers = set()
    original = CompressedCache.memory_bytes

    def watched(self):
        readers.add(threading.current_thread().name)
        return original(self)

    monkeypatch.setattr(CompressedCache, "memory_bytes", watched)
    updates = list(stream(model, tokenizer, "Hello " * 40, Strategy(kv_budget=40), max_new_tokens=24, interval=0.001))
    assert readers == {GENERATION_THREAD}  # read where it is written, published as an immutable snapshot
    final = updates[-1]
    assert final.done and final.stats.compressed_cache_bytes < final.stats.full_cache_bytes


# 2. A consumer that goes away stops the generation, in the engine and through the server.
def test_closing_the_stream_stops_the_generation_thread(slow_tiny):
    model, tokenizer = slow_tiny
    updates = stream(model, tokenizer, "Tell me a story", Strategy(), max_new_tokens=400)
    next(updates)
    assert _generation_threads() == 1
    updates.close()
    assert _wait_for(lambda: _generation_threads() == 0, 1.0)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


SERVER = """
import sys, threading, time
from decodekit import load_model
from decodekit.demo.app import launch
from decodekit.demo.engine import GENERATION_THREAD
model, tokenizer = load_model(sys.argv[1])
model.register_forward_hook(lambda module, args, output: time.sleep(0.02))  # about 20 ms a token
launch(model, tokenizer, port=int(sys.argv[2]), block=False)
print("READY", flush=True)
seen = 0
while True:  # report every change in the number of generation threads
    count = sum(thread.name == GENERATION_THREAD for thread in threading.enumerate())
    if count != seen:
        print("GENERATING", count, flush=True)
        seen = count
    time.sleep(0.01)
"""
CLIENT = """
import sys, time
from gradio_client import Client
client = Client(sys.argv[1], verbose=False)
client.submit(prompt="Tell me a story", max_new_tokens=400, api_name="/generate")
time.sleep(600)
"""


def _read_until(process: subprocess.Popen, expected: str, timeout: float) -> bool:
    """Read the process's output lines until one equals ``expected``; False after ``timeout`` seconds."""
    found = threading.Event()

    def read() -> None:
        for line in process.stdout:
            if line.strip() == expected:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    return found.wait(timeout)


def test_a_client_killed_mid_stream_stops_its_generation(tiny_model_dir):
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(tiny_model_dir), str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert _read_until(server, "READY", 120)
        client = subprocess.Popen([sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}/"])
        assert _read_until(server, "GENERATING 1", 60)
        client.kill()
        client.wait()
        # 400 tokens at 20 ms would take 8 s more; the run must end about as fast as on Stop.
        assert _read_until(server, "GENERATING 0", 3.0), "the generation outlived its client"
    finally:
        server.kill()
        server.wait()


# 3. Every rate agrees with a stopwatch, beam search included.
@pytest.mark.parametrize("strategy", [Strategy(), Strategy(num_beams=3)], ids=["greedy", "beam"])
def test_the_stats_agree_with_a_stopwatch(slow_tiny, strategy):
    model, tokenizer = slow_tiny
    started = time.perf_counter()
    final = list(stream(model, tokenizer, "Hello", strategy, max_new_tokens=20))[-1]
    wall = time.perf_counter() - started
    stats = final.stats
    assert stats.total_seconds <= wall
    decoding = stats.total_seconds - stats.first_token_seconds
    assert stats.tokens_per_second == pytest.approx((stats.steps - 1) / decoding, rel=1e-6)
    assert stats.tokens_per_second < 1 / 0.02  # each step sleeps 20 ms: no more than 50 per second
    shown = format_stats(stats, beam=strategy.beam)  # the page shows the same numbers, rounded
    assert shown["steps/s" if strategy.beam else "tokens/s"] == round(stats.tokens_per_second, 2)


# 4. Concurrent generations are capped across both panels; the queue is bounded.
def test_generations_are_capped_and_the_queue_is_bounded(slow_tiny):
    model, tokenizer = slow_tiny
    from gradio_client import Client

    port = _free_port()
    app = launch(model, tokenizer, port=port, block=False, limits=DemoLimits(max_concurrent=1, max_queue=8))
    try:
        runs = [fn for fn in app.fns.values() if fn.api_name in ("run_a", "run_b", "generate")]
        assert len(runs) == 3 and {fn.concurrency_id for fn in runs} == {"generate"}
        assert all(fn.concurrency_limit == 1 for fn in runs)
        assert app._queue.max_size == 8
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        jobs = [client.submit(prompt=f"Story {i}", max_new_tokens=30, api_name="/generate") for i in range(3)]
        most = 0
        while not all(job.done() for job in jobs):
            most = max(most, _generation_threads())
            time.sleep(0.01)
        assert most == 1 and all(job.result()["stats"]["new tokens"] == 30 for job in jobs)
    finally:
        app.close()


# 5. Temperatures that would overflow are refused; the smallest accepted one samples safely.
def test_temperatures_that_overflow_are_refused_with_the_range():
    for temperature in (1e-300, 1e-45, 1e-7, 1e5, math.inf):
        with pytest.raises(ValueError, match=r"temperature must be a number in \[1e-06, 10000\]"):
            Strategy(temperature=temperature)
    with pytest.raises(ValueError, match=r"temperature must be in \[1e-06, 10000\]"):
        MinPLogitsProcessor(0.1, temperature=1e-300)


def test_the_extreme_accepted_temperatures_sample_without_nan(tiny):
    model, tokenizer = tiny
    greedy = generate_text(model, tokenizer, ["Hello", "Tell me"], Strategy(), max_new_tokens=12)
    cold = Strategy(temperature=1e-6, min_p=0.1, top_p=0.9, top_k=5)
    torch.manual_seed(0)
    assert generate_text(model, tokenizer, ["Hello", "Tell me"], cold, max_new_tokens=12) == greedy
    hot = Strategy(temperature=1e4, min_p=0.05)
    assert len(generate_text(model, tokenizer, ["Hello"], hot, max_new_tokens=12)) == 1


# 6. Beam counts that cannot be allocated, and normalizations that would overflow, are refused.
def test_impossible_beams_and_overflowing_normalizations_are_refused(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match=r"num_beams must be an integer in \[1, 256\]"):
        Strategy(num_beams=1_000_000)
    batch = tokenizer(["Hi"], return_tensors="pt")
    with pytest.raises(ValueError, match=r"num_beams must be an integer in \[1, 256\]"):
        model.generate(**batch, custom_generate=beam_search, num_beams=1_000_000, max_new_tokens=2)
    for alpha in (1e6, 1e308):
        with pytest.raises(ValueError, match=r"length_alpha must be a number in \[0, 5\]"):
            Strategy(num_beams=2, length_alpha=alpha)
    # Over the accepted range, scores stay finite at any reachable length and keep their order
    # (a reward adds reward * length to every hypothesis of that length alike).
    for kind in ("average", "gnmt"):
        sums = torch.tensor([-1.0, -2.0, -1000.0])
        for length in (1, 1_000, 1_000_000):
            assert torch.isfinite(LengthNormalization(kind, alpha=5.0, reward=10.0)(sums, length)).all()
            scores = LengthNormalization(kind, alpha=5.0)(sums, length)
            assert scores[0] > scores[1] > scores[2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "Hi", "--temperature", "1e-300"], "--temperature: must be in [1e-06, 10000]; got 1e-300"),
        (["generate", "Hi", "--num-beams", "1000000"], "--num-beams: must be in [1, 256]"),
        (["generate", "Hi", "--num-beams", "2", "--length-alpha", "1e308"], "--length-alpha: must be in [0, 5]"),
    ],
)
def test_the_cli_refuses_them_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err


# 7. A device map naming a device this machine lacks says which devices exist.
def test_a_missing_device_names_the_devices_present(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "Hi", "--device-map", "cuda"]) == 1
    err = capsys.readouterr().err
    assert "no such device on this machine; it has cpu" in err and "Traceback" not in err
    with pytest.raises(models_module.ModelLoadError, match="'tpu' is not a device"):
        models_module.check_device_map("tpu")
    models_module.check_device_map({"": "cpu"})


# 8. Every real number type is a number, and a bool never is.
@pytest.mark.parametrize(
    ("value", "expected"),
    [(np.float32(0.5), 0.5), (np.float64(0.5), 0.5), (torch.tensor(0.5), 0.5), (np.int64(1), 1.0), (1, 1.0)],
)
def test_every_real_number_type_is_accepted_alike(value, expected):
    strategy = Strategy(temperature=value, top_p=value, min_p=value)
    assert strategy.temperature == strategy.top_p == strategy.min_p == expected
    assert type(strategy.temperature) is float  # stored as a plain number: reports and labels stay clean
    assert MinPLogitsProcessor(value).min_p.scalar == expected
    assert LengthNormalization("gnmt", alpha=value).alpha == expected


def test_integer_types_are_accepted_and_bools_rejected_everywhere():
    strategy = Strategy(top_k=np.int64(5), num_beams=None, kv_budget=torch.tensor(64))
    assert (strategy.top_k, strategy.kv_budget) == (5, 64) and type(strategy.top_k) is int
    assert SizeOptions(budget=np.int32(64)).budget == 64 and type(SizeOptions(budget=np.int32(64)).budget) is int
    for fields in ({"temperature": True}, {"top_p": np.bool_(True)}, {"top_k": True}, {"kv_budget": True},
                   {"frequency_penalty": False}, {"top_k": 2.5}, {"num_beams": 2.0}):  # fmt: skip
        with pytest.raises(ValueError, match=f"{next(iter(fields))} must be"):
            Strategy(**fields)
    with pytest.raises(TypeError, match="min_p must be a number"):
        MinPLogitsProcessor(True)
    with pytest.raises(TypeError, match="min_p must be a number"):
        MinPLogitsProcessor([0.1, True])
    with pytest.raises(ValueError, match="length_alpha must be a number"):
        LengthNormalization("average", alpha=True)


# 9. Bad data files get one line naming the file and the line; reports are written as a set.
@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.jsonl", b'{"prompt": "a"}\n{"prompt": b}\n', r"bad.jsonl line 2: not valid JSON"),
        ("list.jsonl", b'{"prompt": "a"}\n["b"]\n', r"list.jsonl line 2: expected one JSON object per line"),
        ("notjson.json", b"hello, not json", r"notjson.json line 1: not valid JSON"),
        ("empty.jsonl", b"", r"empty.jsonl is empty: expected one JSON object per line"),
        ("empty.csv", b"\n", r"empty.csv is empty"),
        ("header.csv", b"prompt\n", r"header.csv has a header line but no rows"),
        ("empty.txt", b"  \n", r"empty.txt is empty: expected one prompt per line"),
        ("latin.txt", b"fine\ncaf\xe9\n", r"latin.txt line 2: byte 0xe9 is not UTF-8 text"),
    ],
)
def test_bad_prompt_files_are_named_with_the_line(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataFileError, match=message):
        load_prompts(path)
    assert main(["eval", "--prompts", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _report() -> EvaluationReport:
    row = {"strategy": "greedy", "distinct_2": 0.5, "perplexity": 3.0}
    return EvaluationReport(strategies=[row], compression=[{"compression_ratio": 0.0, "perplexity": 3.0}])


def test_an_interrupted_write_leaves_the_previous_complete_set(tmp_path, monkeypatch):
    out = tmp_path / "reports"
    reports_module.write_reports(_report(), out)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert set(before) == set(reports_module.REPORT_FILES)

    def interrupted(report, path):
        raise KeyboardInterrupt

    monkeypatch.setattr(reports_module, "plot_compression", interrupted)  # Ctrl-C after the JSON and CSV
    changed = _report()
    changed.strategies[0]["perplexity"] = 9.0
    with pytest.raises(KeyboardInterrupt):
        reports_module.write_reports(changed, out)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before  # nothing new, nothing left over


def test_ctrl_c_while_the_set_is_moved_into_place_waits_for_the_whole_set():
    finished = []
    with pytest.raises(KeyboardInterrupt), reports_module._interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        finished.append(True)
    assert finished == [True]


@pytest.mark.parametrize("kind", ["file", "below a file"])
def test_a_bad_out_fails_before_any_work(tmp_path, monkeypatch, capsys, kind):
    (tmp_path / "taken").write_text("a file")
    out = tmp_path / "taken" if kind == "file" else tmp_path / "taken" / "reports"

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(models_module, "load_model", no_model)
    assert main(["eval", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "Traceback" not in err


# 10. The default model's cache: unwritable or misplaced folders, and stale staging folders.
@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    from tests.tiny import save_tiny_model

    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF stand-in")
    monkeypatch.setattr(models_module, "_convert_gguf", lambda gguf_path, target: save_tiny_model(target))
    return source


def test_a_corrupt_copy_in_a_read_only_cache_says_what_to_do(fake_gguf, monkeypatch):
    directory = models_module.converted_gguf_dir(fake_gguf)
    (directory / models_module.MANIFEST_NAME).write_text("{garbled")
    monkeypatch.setattr(models_module.os, "access", lambda path, mode: False)  # tests run as root
    with pytest.raises(models_module.ModelLoadError, match="not writable, so it cannot be rebuilt: set DECODEKIT"):
        models_module.converted_gguf_dir(fake_gguf)
    monkeypatch.undo()

    def locked(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "x.lock")

    monkeypatch.setattr(models_module, "FileLock", locked)
    with pytest.raises(models_module.ModelLoadError, match=r"could not convert model\.gguf"):
        models_module.converted_gguf_dir(fake_gguf)


def test_a_cache_dir_below_a_file_is_named(tmp_path, monkeypatch, fake_gguf):
    (tmp_path / "plain").write_text("x")
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path / "plain" / "cache"))
    with pytest.raises(models_module.ModelLoadError, match=r"cannot be created .*set DECODEKIT_CACHE_DIR"):
        models_module.converted_gguf_dir(fake_gguf)


def test_a_killed_conversion_leaves_nothing_behind_after_the_next_run(fake_gguf, tmp_path):
    key = f"{fake_gguf.stem}-{models_module._sha256(fake_gguf)[:16]}"
    stale = tmp_path / "cache" / f".{key}.0123abcd.partial"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half" * 1000)
    models_module.converted_gguf_dir(fake_gguf)
    assert not stale.exists()
    assert [path.name for path in (tmp_path / "cache").iterdir() if path.is_dir()] == [key]


# 11. The demo bounds beams and refuses non-integers and missing values with a message.
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_beams": 2000}, r"num beams must be a whole number in \[1, 8\]; got 2000"),
        ({"num_beams": 2.5}, r"num beams must be a whole number in \[1, 8\]; got 2.5"),
        ({"top_k": 2.7}, r"top k must be a whole number in \[1, "),
        ({"temperature": "hot"}, r"temperature must be a number"),
    ],
)
def test_the_demo_refuses_bad_controls(overrides, message):
    with pytest.raises(gradio.Error, match=message):
        strategy_from_controls("greedy", overrides)
    assert strategy_from_controls("greedy", {"num_beams": 4.0}).num_beams == 4


@pytest.mark.parametrize("max_new_tokens", ["abc", None, 0, 10_000, 2.5])
def test_the_demo_refuses_bad_token_counts(tiny, max_new_tokens):
    model, tokenizer = tiny
    session = DemoSession(model, tokenizer)
    with pytest.raises(gradio.Error, match=r"max new tokens must be a whole number in \[1, 512\]"):
        next(session.generate("Hi", max_new_tokens, "greedy"))
    assert session.running() == 0


# 12. Processors say that scores must be [batch, vocab].
@pytest.mark.parametrize(
    "processor",
    [
        MinPLogitsProcessor([0.1, 0.2]),
        StagedRepetitionPenaltyLogitsProcessor("1:1.2"),
        FrequencyPresencePenaltyLogitsProcessor(0.5, 0.5, prompt_length=0),
        GumbelSamplingLogitsProcessor([1, 2], prompt_length=0),
    ],
    ids=lambda processor: type(processor).__name__,
)
def test_processors_name_the_shape_they_need(processor):
    with pytest.raises(ValueError, match=r"scores must be a \[batch, vocab\] tensor; got \(16,\)"):
        processor(torch.tensor([[1, 2]]), torch.zeros(16))


# 13. decodekit eval checks what it can before the first generation.
def test_eval_checks_the_reference_length_before_generating(tiny, monkeypatch):
    model, tokenizer = tiny

    def no_generation(*args, **kwargs):
        raise AssertionError("generated before the settings were checked")

    monkeypatch.setattr(runner_module, "generate_text", no_generation)
    with pytest.raises(ValueError, match="context_tokens \\+ continuation_tokens = 100000 \\+ 256"):
        evaluate_strategies(model, tokenizer, ["Hi"], context_tokens=100_000, progress=False)
    with pytest.raises(ValueError, match="compression_ratios"):
        evaluate_strategies(model, tokenizer, ["Hi"], compression_ratios=(0.5, 1.0), progress=False)


def test_report_json_holds_plain_numbers_for_numpy_inputs(tmp_path):
    strategy = Strategy(temperature=np.float32(0.5), top_k=np.int64(3))
    report = EvaluationReport(strategies=[{"strategy": strategy.label, **strategy.to_dict(), "distinct_2": 0.1}])
    report.compression = [{"compression_ratio": 0.0, "perplexity": 2.0}]
    paths = reports_module.write_reports(report, tmp_path)
    assert json.loads(Path(paths["report.json"]).read_text())["strategies"][0]["top_k"] == 3
