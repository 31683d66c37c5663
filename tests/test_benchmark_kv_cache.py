"""The cache benchmark's default run still runs on the default model (a short configuration; its figures are
not asserted here)."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_runs import refused_benchmark, run_benchmark


@pytest.mark.slow  # the benchmark loads the default model
def test_kv_cache_benchmark_runs_and_prints_its_ratios(tmp_path):
    short = ["--context-tokens", "128", "--continuation-tokens", "16", "--speed-prompt", "256", "--speed-tokens", "4"]
    short += ["--texts", "gpl3", "--pass-keys", "1", "--pass-key-filler", "4"]  # one text: the recorded
    short += ["--prefill-tokens", "256", "--prefill-rounds", "1"]  # presses' other texts must be left out
    presses = tmp_path / "presses.jsonl"  # a recorded kvpress run, so that the comparison code runs too
    rows = [{"method": "kvpress SnapKV", "ratio": r, "task": t, "perplexity": 1e9} for r in (0.5, 0.75, 0.9)
            for t in ("gpl3", "argparse.py", "pydoc types", "idle NEWS")]  # fmt: skip
    rows += [{"method": "kvpress SnapKV", "ratio": r, "task": "pass key", "accuracy": 0.0} for r in (0.5, 0.75, 0.9)]
    presses.write_text("\n".join(json.dumps(row) for row in rows))
    byte_presses = tmp_path / "byte_presses.jsonl"  # the per-byte section's recorded presses
    rows = [{"method": "kvpress KVzip", "ratio": r, "task": t, "perplexity": 1e9} for r in (0.5, 0.75)
            for t in ("gpl3", "argparse.py", "pydoc types", "idle NEWS")]  # fmt: skip
    rows += [{"method": "kvpress KVzip", "ratio": r, "task": "pass key", "accuracy": 0.5} for r in (0.5, 0.75)]
    byte_presses.write_text("\n".join(json.dumps(row) for row in rows))
    short += ["--byte-shares", "0.75", "--retrieval-tasks", "1", "--retrieval-tokens", "150"]
    short += ["--byte-presses-from", str(byte_presses)]
    short += ["--peak-new-tokens", "4", "--peak-chunks", "64,128"]  # section 5: the prompt is --prefill-tokens'
    out = run_benchmark("kv_cache.py", *short, "--long-tokens", "8", "--presses-from", str(presses))
    assert "decodekit default" in out and "decodekit reconstruction" in out and "kvpress SnapKV" in out
    assert "default better than every press: True" in out
    assert "CompressedCache / DynamicCache prefill time" in out
    assert "CompressedCache / DynamicCache tokens/s" in out
    assert "most tokens held at any step" in out
    assert "CompressedCache kv_bits=4:" in out
    assert out.count("CompressedCache memory_fraction=0.25, scoring=reconstruction: ") == 2  # prefill; decoding
    assert "CompressedCache memory_fraction=0.25, scoring=reconstruction, replay=forward: " in out
    assert "CompressedCache scoring='reconstruction' (layers share the budget" in out
    assert "CompressedCache scoring='reconstruction' (layers and KV heads share the budget" in out
    # Quality per byte: ours sized by bytes, held within them, beside the recorded press at the same share.
    assert "1b. quality per byte" in out and "kvpress KVzip" in out and "decodekit reconstruction 16-bit" in out
    assert "75.0% of the bytes removed, decodekit reconstruction: held" in out and "target <= +0.25%" in out
    assert "vs KVzip's +" in out and "within 25.0%: True" in out and "False)" not in out
    # Section 5: the chunked rows hold at most the fraction plus one chunk at every moment of generate.
    assert "(256-token prompt, 4 new tokens)" in out
    assert out.count("fraction + one chunk, meets") == 4  # attention and reconstruction scores, two chunks each


def test_kv_cache_benchmark_refuses_an_unknown_text_by_name():
    stderr = refused_benchmark("kv_cache.py", "--texts", "gpl3, no such text")
    assert "--texts: unknown ['no such text']; name one or more of gpl3, argparse.py" in stderr


def test_kv_cache_benchmark_refuses_texts_that_name_nothing():
    import argparse
    import sys

    from tests.benchmark_runs import BENCHMARKS

    sys.path.insert(0, str(BENCHMARKS))
    from kv_cache import protocol_texts

    for names in ("", " , ,"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"no text named; name one or more of gpl3, argparse\.py"):
            protocol_texts(names)
    assert list(protocol_texts("argparse.py, gpl3")) == ["gpl3", "argparse.py"]  # in the protocol's order
