"""The cache benchmark's retrieval tasks: facts hidden in natural prose, asked after the context."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from kv_protocol import PROTOCOL_TEXTS, TUNING_TEXTS
from kv_retrieval import HAYSTACKS, KINDS, _insert, retrieval_tasks


@pytest.mark.parametrize("kind", KINDS)
def test_each_task_hides_its_answer_in_prose_at_evenly_spread_depths(tiny, kind):
    _, tokenizer = tiny
    tasks = retrieval_tasks(tokenizer, kind, count=10, seed=3, context_tokens=600)
    assert [task["depth"] for task in tasks] == [round((i + 0.5) / 10, 3) for i in range(10)]
    assert {task["haystack"] for task in tasks} == set(HAYSTACKS)
    for task in tasks:
        context, question = tokenizer.decode(task["context"]), tokenizer.decode(task["question"])
        assert task["answer"] in context and task["answer"] not in question  # asked after, answered before
        assert len(task["answer"]) == 5 and task["answer"].isdigit()
        if kind == "multi key":
            assert context.count("The special magic number for") == 4
            asked = question.split("for ")[1].split("?")[0]
            assert f"The special magic number for {asked} is {task['answer']}." in context
        else:
            assert f"The pass key is {task['answer']}." in context and question.endswith("The pass key is")
    for haystack in HAYSTACKS:  # deeper tasks place the asked fact later in the same prose
        places = [
            tokenizer.decode(task["context"]).find(task["answer"]) for task in tasks if task["haystack"] == haystack
        ]
        assert places == sorted(places)
    assert retrieval_tasks(tokenizer, kind, count=10, seed=3, context_tokens=600) == tasks  # reproducible


def test_a_fact_goes_after_the_first_sentence_end_at_or_past_its_depth():
    prose = "Aa aa. Bb bb. Cc cc. Dd dd. Ee ee."  # 34 characters; sentence ends at 5, 12, 19, 26
    assert _insert(prose, ["X."], [0.0]) == "Aa aa. X. Bb bb. Cc cc. Dd dd. Ee ee."
    assert _insert(prose, ["X.", "Y."], [0.5, 0.2]) == "Aa aa. Bb bb. Y. Cc cc. X. Dd dd. Ee ee."
    assert _insert(prose, ["Z."], [0.99]) == prose + "Z. "  # no sentence end left: at the end


def test_the_haystacks_share_no_text_with_the_protocol_or_the_tuning_texts():
    haystacks = {name: load() for name, load in HAYSTACKS.items()}
    others = {name: load() for name, (_, load) in {**PROTOCOL_TEXTS, **TUNING_TEXTS}.items()}
    for name, text in haystacks.items():
        sentences = [sentence.strip() for sentence in text.split(".") if len(sentence.strip()) > 60]
        assert len(sentences) > 20, name
        for other_name, other in others.items():
            shared = [sentence for sentence in sentences if sentence in other]
            assert len(shared) <= len(sentences) // 20, (name, other_name, shared[:2])


def test_a_bad_kind_is_named(tiny):
    _, tokenizer = tiny
    with pytest.raises(ValueError, match="kind must be one of 'single key', 'multi key'; got 'kv'"):
        retrieval_tasks(tokenizer, "kv", count=1)
