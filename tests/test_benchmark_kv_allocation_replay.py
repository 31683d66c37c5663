"""The allocation and replay ablations still run, and their masks reproduce the evicting cache (short
configurations; apart from the other ablations so that pytest-xdist can run them side by side)."""

from __future__ import annotations

import pytest

from tests.benchmark_runs import run_benchmark

# 128-token contexts of one tuning text: what the tests check holds per text.
ONE_TEXT = ("--texts", "inspect.py", "--context-tokens", "128", "--continuation-tokens", "16")


@pytest.mark.slow  # the benchmark loads the default model
def test_the_allocation_ablation_runs_and_its_uniform_row_is_the_cache_itself():
    out = run_benchmark("kv_allocation.py", *ONE_TEXT, "--ratios", "0.5")
    rows = {line[:30].strip(): line[30:].strip() for line in out.splitlines() if line.startswith("  ")}
    assert out.startswith("tuning texts (inspect.py):")  # the text named, alone
    assert {"uniform", "per layer", "global", "global, layer-normalized"} <= set(rows)
    assert rows["uniform"] == rows["CompressedCache, evicting"]  # the masks reproduce the evicting cache


@pytest.mark.slow  # the benchmark loads the default model
def test_the_allocation_ablation_on_reconstruction_scores_reproduces_the_global_cache():
    out = run_benchmark(
        "kv_allocation.py", *ONE_TEXT, "--ratios", "0.5",
        "--scoring", "reconstruction", "--allocations", "CompressedCache, evicting;layers;uniform",
    )  # fmt: skip
    rows = {line[:30].strip(): line[30:].strip() for line in out.splitlines() if line.startswith("  ")}
    assert "reconstruction scores" in out
    assert rows["layers"] == rows["CompressedCache, evicting"]  # allocation="global" is the "layers" masks
    assert rows["layers"] != rows["uniform"]


@pytest.mark.slow  # the benchmark loads the default model
def test_the_replay_ablation_runs_and_its_masks_are_the_evicting_cache():
    """Also at 75% evicted of 128 tokens, where the share (32 tokens) is under the cache's floor (36), which the
    masks keep as the cache does."""
    out = run_benchmark(
        "kv_replay.py", *ONE_TEXT, "--ratios", "0.5,0.75",
        "--chunk", "64", "--rows", "plain;KVzip+", "--floors", "0.2", "--with-cache",
    )  # fmt: skip
    rows = {(line[2:20].strip(), line[20:27].strip()): line[27:] for line in out.splitlines() if line.startswith("  ")}
    assert out.startswith("tuning texts (inspect.py):")
    assert rows["plain", "20%"] == rows["plain", "cache"]
    assert rows["KVzip+", "20%"] == rows["KVzip+", "cache"]
    assert rows["plain", "20%"] != rows["KVzip+", "20%"]
