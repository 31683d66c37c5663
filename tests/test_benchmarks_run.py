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


def test_rematching_a_recorded_report_prints_what_the_results_file_records(tmp_path):
    """The recorded sampler table matched again from its CSV prints the lines the results file keeps for it (the
    samplers whose rows sit far from 0.8 not compared, top-n-sigma clear of min-p), and draws matched.png."""
    from pathlib import Path

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    out = run_benchmark("eval_rematch.py", str(results / "samplers_matched_cpu.csv"), "--target", "0.8",
                        "--plot", str(tmp_path / "matched.png"))  # fmt: skip
    recorded = (results / "samplers_matched_cpu.txt").read_text().splitlines()
    assert out.strip().splitlines() == recorded[-len(out.strip().splitlines()):]
    assert "min-k 0.5, T=1" in out and "not compared" in out and "clear of: min_p" in out
    assert (tmp_path / "matched.png").stat().st_size > 0
