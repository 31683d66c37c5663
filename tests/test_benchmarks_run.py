"""The benchmark scripts still run (a short configuration; their figures are not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, *args: str) -> str:
    # The timeout only guards against a hang: the longest run takes about 65 s on an idle 2-core machine,
    # and several times that on a shared one.
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=1200, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_processor_benchmark_runs_and_prints_its_ratios():
    out = _run("processors.py", "--rounds", "1", "--generate-rounds", "0")
    assert "min-p speedup over MinPLogitsWarper" in out
    assert "staged penalty / RepetitionPenalty" in out
    assert "32-bit / 24-bit time" in out
    assert all(f"{name} " in out for name in ("Top-H", "typical", "epsilon", "eta"))


def test_beam_search_benchmark_runs_and_prints_its_ratio():
    out = _run("beam_search.py", "--rounds", "1", "--max-new-tokens", "4")
    assert "decodekit / built-in time" in out
    assert "outputs identical: True" in out


def test_kv_cache_benchmark_runs_and_prints_its_ratios(tmp_path):
    short = ["--context-tokens", "256", "--continuation-tokens", "32", "--speed-prompt", "256", "--speed-tokens", "4"]
    short += ["--pass-keys", "1", "--pass-key-filler", "4", "--prefill-tokens", "256", "--prefill-rounds", "1"]
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
    short += ["--byte-shares", "0.5,0.75", "--retrieval-tasks", "1", "--retrieval-tokens", "200"]
    short += ["--byte-presses-from", str(byte_presses)]
    out = _run("kv_cache.py", *short, "--long-tokens", "8", "--presses-from", str(presses))
    assert "decodekit default" in out and "decodekit reconstruction" in out and "kvpress SnapKV" in out
    assert "default better than every press: True" in out
    assert "CompressedCache / DynamicCache prefill time" in out
    assert "CompressedCache / DynamicCache tokens/s" in out
    assert "most tokens held at any step" in out
    assert "CompressedCache kv_bits=4:" in out
    assert "CompressedCache scoring='reconstruction' (layers share the budget" in out
    assert "CompressedCache scoring='reconstruction' (layers and KV heads share the budget" in out
    # Quality per byte: ours sized by bytes, held within them, beside the recorded press at the same share.
    assert "1b. quality per byte" in out and "kvpress KVzip" in out and "decodekit reconstruction 16-bit" in out
    assert "75.0% of the bytes removed, decodekit reconstruction: held" in out and "target <= +0.25%" in out
    assert "vs KVzip's +" in out and "within 25.0%: True" in out and "False)" not in out


def test_kv_cache_benchmark_host_bound_mode_runs():
    out = _run("kv_cache.py", "--host-bound", "--host-prompt", "64", "--host-tokens", "4", "--host-rounds", "1",
               "--no-host-compile")  # fmt: skip
    assert "CompressedCache / DynamicCache tokens/s, host-bound" in out and "kv_bits=4" in out


def test_kv_bytes_benchmark_runs_and_prints_its_rows():
    short = ["--context-tokens", "256", "--continuation-tokens", "32", "--fractions", "0.5", "--bits", "16,8/4"]
    out = _run("kv_bytes.py", *short)
    rows = [line.split() for line in out.splitlines() if line.lstrip().startswith("50%")]
    assert [row[1] for row in rows] == ["16", "8/4"]


def test_kv_key_coding_benchmark_prints_a_row_per_scheme():
    out = _run("kv_key_coding.py", "--context-tokens", "128", "--continuation-tokens", "16")
    rows = {line[:38].strip() for line in out.splitlines() if line.rstrip().endswith("%")}
    assert {"rotated, groups of 32", "plain, groups of 32", "channel magnitude, groups of 32"} <= rows
    assert len(rows) == 5


def test_kv_cache_benchmark_gpu_mode_runs_on_cpu_with_a_tiny_shape():
    out = _run("kv_cache.py", "--shape", "tiny", "--lengths", "256,512", "--gpu-tokens", "4", "--device", "cpu")
    assert "CompressedCache observation_window=64" in out and "DynamicCache" in out
    assert "CompressedCache eviction_interval=8" in out and "compiled decoding" not in out  # none asked on a CPU


def test_kv_cache_benchmark_gpu_mode_compiled_section_runs_on_cpu():
    out = _run("kv_cache.py", "--shape", "tiny", "--lengths", "256", "--gpu-tokens", "4", "--gpu-rounds", "1",
               "--device", "cpu", "--no-gpu-eager", "--gpu-compile-modes", "default")  # fmt: skip
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("256 ")]
    assert [(row[1], row[-4]) for row in rows] == [
        ("StaticCache", "eager"), ("StaticCache", "default"), ("CompressedCache(budget=64,", "eager"),
        ("CompressedCache(budget=64,", "default"),
    ]  # fmt: skip
    assert "failed" not in out


def test_eval_benchmark_runs_and_prints_its_ratio():
    out = _run("eval.py", "--rounds", "1", "--texts", "6", "--batch-size", "3")
    assert "decodekit / canonical tokens/s" in out
    assert "largest relative difference" in out


def test_the_retrieval_benchmark_runs_and_prints_its_table():
    out = _run(
        "kv_retrieval.py", "--count", "2", "--context-tokens", "300", "--ratios", "0.5", "--scorings", "attention"
    )
    assert "natural-prose contexts" in out
    assert "single key  attention" in out and "multi key   attention" in out


def test_the_allocation_ablation_runs_and_its_uniform_row_is_the_cache_itself():
    out = _run("kv_allocation.py", "--context-tokens", "256", "--continuation-tokens", "32", "--ratios", "0.5")
    rows = {line[:30].strip(): line[30:].strip() for line in out.splitlines() if line.startswith("  ")}
    assert {"uniform", "per layer", "global", "global, layer-normalized"} <= set(rows)
    assert rows["uniform"] == rows["CompressedCache, evicting"]  # the masks reproduce the evicting cache


def test_the_allocation_ablation_on_reconstruction_scores_reproduces_the_global_cache():
    out = _run(
        "kv_allocation.py", "--context-tokens", "256", "--continuation-tokens", "32", "--ratios", "0.75",
        "--scoring", "reconstruction", "--allocations", "CompressedCache, evicting;layers;uniform",
    )  # fmt: skip
    rows = {line[:30].strip(): line[30:].strip() for line in out.splitlines() if line.startswith("  ")}
    assert "reconstruction scores" in out
    assert rows["layers"] == rows["CompressedCache, evicting"]  # allocation="global" is the "layers" masks
    assert rows["layers"] != rows["uniform"]


def test_the_replay_ablation_runs_and_its_masks_are_the_evicting_cache():
    out = _run(
        "kv_replay.py", "--context-tokens", "256", "--continuation-tokens", "32", "--ratios", "0.5,0.75",
        "--chunk", "128", "--rows", "plain;KVzip+", "--floors", "0.2", "--with-cache",
    )  # fmt: skip
    rows = {(line[2:20].strip(), line[20:27].strip()): line[27:] for line in out.splitlines() if line.startswith("  ")}
    assert rows["plain", "20%"] == rows["plain", "cache"]
    assert rows["KVzip+", "20%"] == rows["KVzip+", "cache"]
    assert rows["plain", "20%"] != rows["KVzip+", "20%"]
