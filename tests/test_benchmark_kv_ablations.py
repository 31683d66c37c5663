"""The cache's ablation and per-byte benchmarks still run, and their masks reproduce the evicting cache
(short configurations)."""

from __future__ import annotations

from tests.benchmark_runs import run_benchmark


def test_kv_bytes_benchmark_runs_and_prints_its_rows():
    short = ["--context-tokens", "256", "--continuation-tokens", "32", "--fractions", "0.5", "--bits", "16,8/4"]
    out = run_benchmark("kv_bytes.py", *short)
    rows = [line.split() for line in out.splitlines() if line.lstrip().startswith("50%")]
    assert [row[1] for row in rows] == ["16", "8/4"]


def test_kv_key_coding_benchmark_refuses_an_unknown_scheme_by_name():
    import subprocess
    import sys

    from tests.benchmark_runs import BENCHMARKS

    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "kv_key_coding.py"), "--schemes", "rotated;no such scheme"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--schemes: unknown ['no such scheme', 'rotated']" in result.stderr


def test_kv_key_coding_benchmark_prints_a_row_per_scheme():
    out = run_benchmark("kv_key_coding.py", "--context-tokens", "128", "--continuation-tokens", "16")
    rows = {line[:44].strip() for line in out.splitlines() if line.rstrip().endswith("%")}
    assert {"rotated, groups of 32", "plain, groups of 32", "channel magnitude, groups of 32"} <= rows
    assert {"rotated in blocks of 32, groups of 32", "rotated in blocks of 16, groups of 32"} <= rows
    assert {"rotated, groups of 32, first token exact", "rotated, groups of 32, first 4 exact"} <= rows
    assert {"rotated, groups of 32, 5 bits", "rotated, groups of 32, 8 bits"} <= rows
    assert len(rows) == 12


def test_kv_key_coding_benchmark_runs_the_named_schemes_on_the_second_tuning_texts():
    schemes = "rotated, groups of 32;rotated, groups of 32, 5 bits"
    short = ["--context-tokens", "128", "--continuation-tokens", "16", "--texts", "tuning2", "--schemes", schemes]
    out = run_benchmark("kv_key_coding.py", *short)
    rows = [line[:44].strip() for line in out.splitlines() if line.rstrip().endswith("%")]
    assert rows == schemes.split(";")
    assert out.startswith("tuning2 texts") and "typing.py" in out


def test_the_retrieval_benchmark_runs_and_prints_its_table():
    out = run_benchmark(
        "kv_retrieval.py", "--count", "2", "--context-tokens", "300", "--ratios", "0.5", "--scorings", "attention"
    )
    assert "natural-prose contexts" in out
    assert "single key  attention" in out and "multi key   attention" in out


def test_the_allocation_ablation_runs_and_its_uniform_row_is_the_cache_itself():
    out = run_benchmark("kv_allocation.py", "--context-tokens", "256", "--continuation-tokens", "32", "--ratios", "0.5")
    rows = {line[:30].strip(): line[30:].strip() for line in out.splitlines() if line.startswith("  ")}
    assert {"uniform", "per layer", "global", "global, layer-normalized"} <= set(rows)
    assert rows["uniform"] == rows["CompressedCache, evicting"]  # the masks reproduce the evicting cache


def test_the_allocation_ablation_on_reconstruction_scores_reproduces_the_global_cache():
    out = run_benchmark(
        "kv_allocation.py", "--context-tokens", "256", "--continuation-tokens", "32", "--ratios", "0.75",
        "--scoring", "reconstruction", "--allocations", "CompressedCache, evicting;layers;uniform",
    )  # fmt: skip
    rows = {line[:30].strip(): line[30:].strip() for line in out.splitlines() if line.startswith("  ")}
    assert "reconstruction scores" in out
    assert rows["layers"] == rows["CompressedCache, evicting"]  # allocation="global" is the "layers" masks
    assert rows["layers"] != rows["uniform"]


def test_the_replay_ablation_runs_and_its_masks_are_the_evicting_cache():
    out = run_benchmark(
        "kv_replay.py", "--context-tokens", "256", "--continuation-tokens", "32", "--ratios", "0.5,0.75",
        "--chunk", "128", "--rows", "plain;KVzip+", "--floors", "0.2", "--with-cache",
    )  # fmt: skip
    rows = {(line[2:20].strip(), line[20:27].strip()): line[27:] for line in out.splitlines() if line.startswith("  ")}
    assert rows["plain", "20%"] == rows["plain", "cache"]
    assert rows["KVzip+", "20%"] == rows["KVzip+", "cache"]
    assert rows["plain", "20%"] != rows["KVzip+", "20%"]
