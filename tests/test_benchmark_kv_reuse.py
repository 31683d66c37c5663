"""The reuse benchmark still runs (the tiny model, a short configuration; its figures are not asserted here), and its
document hides one keyed number per question at evenly spread depths."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.benchmark_runs import refused_benchmark, run_benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_the_reuse_benchmark_runs_and_prints_each_part(tiny_model_dir):
    out = run_benchmark(
        "kv_reuse.py", "--model", str(tiny_model_dir), "--document-tokens", "600", "--questions", "3", "--rounds", "1",
        "--new-tokens", "4", "--retrieval-count", "1", "--retrieval-tokens", "300", "--retrieval-full",
    )  # fmt: skip
    lines = out.splitlines()
    assert lines[0].startswith("# python benchmarks/kv_reuse.py --model") and lines[1].startswith("# ")
    parts = (
        "full cache / saved context time:", "against the full cache saved the same way",
        "against a full 16-bit cache's",
        "answers from the loaded context identical to the context compressed in this process: 3 of 3",
        "answers from disk identical to in process: 2 of 2", "full cache",
    )  # fmt: skip
    for part in parts:
        assert part in out, part


def test_the_benchmark_document_hides_a_keyed_number_for_each_question(tiny):
    from kv_reuse import keyed_document

    _, tokenizer = tiny
    ids, asked = keyed_document(tokenizer, 900, 5)
    text = tokenizer.decode(ids)
    assert sorted(item["depth"] for item in asked) == [0.1, 0.3, 0.5, 0.7, 0.9]
    for item in asked:
        assert text.count(f"The special magic number for {item['key']} is {item['answer']}.") == 1
        assert tokenizer.decode(item["question"]).endswith(f"The special magic number for {item['key']} is")
    places = [text.find(item["answer"]) for item in sorted(asked, key=lambda item: item["depth"])]
    assert places == sorted(places)  # deeper keys lie later in the document


def test_bad_arguments_are_refused_before_the_model_loads():
    assert "--questions must be >= 1" in refused_benchmark("kv_reuse.py", "--questions", "0")
    assert "--memory-fraction must be in (0, 1]" in refused_benchmark("kv_reuse.py", "--memory-fraction", "2")
