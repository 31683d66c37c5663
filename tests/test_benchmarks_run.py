"""The benchmark scripts still run (a short configuration; their figures are not asserted here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_processor_benchmark_runs_and_prints_its_ratios():
    out = _run("processors.py", "--rounds", "1", "--generate-rounds", "0")
    assert "min-p speedup over MinPLogitsWarper" in out
    assert "staged penalty / RepetitionPenalty" in out


def test_beam_search_benchmark_runs_and_prints_its_ratio():
    out = _run("beam_search.py", "--rounds", "1", "--max-new-tokens", "4")
    assert "decodekit / built-in time" in out
    assert "outputs identical: True" in out


def test_kv_cache_benchmark_runs_and_prints_its_ratios():
    short = ["--context-tokens", "256", "--continuation-tokens", "32", "--speed-prompt", "256", "--speed-tokens", "4"]
    out = _run("kv_cache.py", *short, "--long-tokens", "8", "--skip-kvpress")
    assert "decodekit CompressedCache" in out
    assert "CompressedCache / DynamicCache tokens/s" in out
    assert "most tokens held at any step" in out


def test_eval_benchmark_runs_and_prints_its_ratio():
    out = _run("eval.py", "--rounds", "1", "--texts", "6", "--batch-size", "3")
    assert "decodekit / canonical tokens/s" in out
    assert "largest relative difference" in out
