"""The sampling, beam search and evaluation benchmarks still run (a short configuration; their figures are not
asserted here)."""

from __future__ import annotations

import pytest

from tests.benchmark_runs import run_benchmark


def test_processor_benchmark_runs_and_prints_its_ratios():
    out = run_benchmark("processors.py", "--rounds", "1", "--generate-rounds", "0")
    assert "min-p speedup over MinPLogitsWarper" in out
    assert "staged penalty / RepetitionPenalty" in out
    assert "32-bit / 24-bit time" in out
    assert all(f"{name} " in out for name in ("Top-H", "typical", "epsilon", "eta"))


@pytest.mark.slow  # the benchmark loads the default model
def test_beam_search_benchmark_runs_and_prints_its_ratio():
    out = run_benchmark("beam_search.py", "--rounds", "1", "--max-new-tokens", "4")
    assert "decodekit / built-in time" in out
    assert "outputs identical: True" in out


@pytest.mark.slow  # the benchmark loads the default model
def test_eval_benchmark_runs_and_prints_its_ratio():
    out = run_benchmark("eval.py", "--rounds", "1", "--texts", "6", "--batch-size", "3")
    assert "decodekit / canonical tokens/s" in out
    assert "largest relative difference" in out
