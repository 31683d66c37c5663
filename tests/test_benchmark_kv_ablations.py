"""The cache's ablation and per-byte benchmarks still run, and their masks reproduce the evicting cache
(short configurations)."""

from __future__ import annotations

import pytest

from tests.benchmark_runs import refused_benchmark, run_benchmark


@pytest.mark.slow  # the benchmark loads the default model
def test_kv_bytes_benchmark_runs_and_prints_its_rows():
    short = ["--only", "inspect.py", "--context-tokens", "128", "--continuation-tokens", "16", "--fractions", "0.5"]
    short += ["--bits", "16,8/4"]
    out = run_benchmark("kv_bytes.py", *short)
    rows = [line.split() for line in out.splitlines() if line.lstrip().startswith("50%")]
    assert [row[1] for row in rows] == ["16", "8/4"]


def test_kv_key_coding_benchmark_refuses_an_unknown_scheme_by_name():
    stderr = refused_benchmark("kv_key_coding.py", "--schemes", "rotated;no such scheme")
    assert "--schemes: unknown ['no such scheme', 'rotated']" in stderr


@pytest.mark.slow  # the benchmark loads the default model
def test_kv_key_coding_benchmark_prints_a_row_per_scheme():
    short = ["--only", "inspect.py", "--context-tokens", "128", "--continuation-tokens", "16"]
    out = run_benchmark("kv_key_coding.py", *short)
    assert out.splitlines()[1].split() == ["scheme", "inspect.py", "mean", "worst"]  # the one text named
    rows = {line[:44].strip() for line in out.splitlines() if line.rstrip().endswith("%")}
    assert {"rotated, groups of 32", "plain, groups of 32", "channel magnitude, groups of 32"} <= rows
    assert {"rotated in blocks of 32, groups of 32", "rotated in blocks of 16, groups of 32"} <= rows
    assert {"rotated, groups of 32, first token exact", "rotated, groups of 32, first 4 exact"} <= rows
    assert {"rotated, groups of 32, 5 bits", "rotated, groups of 32, 8 bits"} <= rows
    assert len(rows) == 12


@pytest.mark.slow  # the benchmark loads the default model
def test_kv_key_coding_benchmark_runs_the_named_schemes_on_the_second_tuning_texts():
    schemes = "rotated, groups of 32;rotated, groups of 32, 5 bits"
    short = ["--context-tokens", "128", "--continuation-tokens", "16", "--texts", "tuning2", "--schemes", schemes]
    out = run_benchmark("kv_key_coding.py", *short, "--only", "typing.py, gpl2")
    rows = [line[:44].strip() for line in out.splitlines() if line.rstrip().endswith("%")]
    assert rows == schemes.split(";")
    assert out.startswith("tuning2 texts") and out.splitlines()[1].split()[1:3] == ["typing.py", "gpl2"]


def test_a_benchmarks_texts_are_named_from_its_set_and_unknown_names_are_refused():
    import argparse
    import sys

    from tests.benchmark_runs import BENCHMARKS

    sys.path.insert(0, str(BENCHMARKS))
    from kv_protocol import SECOND_TUNING_TEXTS, TUNING_TEXTS, texts_named

    assert list(texts_named("gpl2 ,typing.py", SECOND_TUNING_TEXTS)) == ["typing.py", "gpl2"]  # the set's order
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown \['typing.py'\]; name one or more of pydoc data"):
        texts_named("inspect.py,typing.py", TUNING_TEXTS)
    with pytest.raises(argparse.ArgumentTypeError, match="no text named; name one or more of pydoc strings"):
        texts_named(" , ", SECOND_TUNING_TEXTS)


@pytest.mark.slow  # the benchmark loads the default model
def test_the_retrieval_benchmark_runs_and_prints_its_table():
    out = run_benchmark(
        "kv_retrieval.py", "--count", "1", "--context-tokens", "300", "--ratios", "0.5", "--scorings", "attention",
        "--kv-bits", "8",
    )  # fmt: skip
    assert "natural-prose contexts" in out
    assert "single key  attention, kv_bits 8" in out and "multi key   attention, kv_bits 8" in out
