"""The step-speed benchmark still runs on a tiny model (its figures are not asserted here) and refuses bad widths
and sizes before the model loads."""

from __future__ import annotations

import pytest

from tests.benchmark_runs import refused_benchmark, run_benchmark


def test_the_step_speed_benchmark_prints_each_cache_against_dynamic_cache(tiny_model_dir):
    out = run_benchmark("kv_step_speed.py", "--model", str(tiny_model_dir), "--fraction", "0.5", "--bits", "model,3/2",
                        "--prompt-tokens", "80", "--new-tokens", "2", "--rounds", "1")  # fmt: skip
    rows = [line for line in out.splitlines() if "ms/step" in line]
    assert [row.split()[0] for row in rows] == ["DynamicCache", "memory_fraction=0.5,", "memory_fraction=0.5,"]
    assert "bits model" in rows[1] and "bits 3/2" in rows[2]
    assert rows[0].rstrip().endswith("1.00x DynamicCache")


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--bits", "6/4", "each width is model or K/V with K and V in 16, 8, 5, 4, 3, 2; got '6/4'"),
    ("--bits", "4", "each width is model or K/V"),
    ("--fraction", "0", "a memory fraction in (0, 1]; got '0'"),
    ("--new-tokens", "0", "a whole number of at least 1; got '0'"),
])  # fmt: skip
def test_bad_arguments_are_refused_before_the_model_loads(flag, value, message):
    assert message in refused_benchmark("kv_step_speed.py", flag, value)
