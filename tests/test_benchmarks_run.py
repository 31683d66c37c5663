"""The benchmark scripts still run (a short configuration; their figures are not asserted here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_processor_benchmark_runs_and_prints_its_ratios():
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "processors.py"), "--rounds", "1", "--generate-rounds", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "min-p speedup over MinPLogitsWarper" in result.stdout
    assert "staged penalty / RepetitionPenalty" in result.stdout


def test_beam_search_benchmark_runs_and_prints_its_ratio():
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "beam_search.py"), "--rounds", "1", "--max-new-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "decodekit / built-in time" in result.stdout
    assert "outputs identical: True" in result.stdout


def test_kv_cache_benchmark_runs_and_prints_its_ratios():
    short = ["--context-tokens", "256", "--continuation-tokens", "32", "--speed-prompt", "256", "--speed-tokens", "4"]
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "kv_cache.py"), *short, "--long-tokens", "8", "--skip-kvpress"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "decodekit CompressedCache" in result.stdout
    assert "CompressedCache / DynamicCache tokens/s" in result.stdout
    assert "most tokens held at any step" in result.stdout
