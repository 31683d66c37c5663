"""Batch invariance as a property: every recipe gives a prompt the same result alone or in a padded batch."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.batch_invariance import check, grid
from tests.tiny import _training_text

WORDS = " ".join(_training_text()).split()
PROMPT_SETS = [
    ["Name a color.", " ".join(WORDS[:90])],
    ["x", " ".join(WORDS[200:230]), " ".join(WORDS[400:520])],
]


def _prompt(start: int, length: int) -> str:
    return " ".join(WORDS[start : start + length])


prompt_sets = st.lists(
    st.builds(_prompt, st.integers(0, len(WORDS) - 200), st.sampled_from([1, 3, 12, 40, 120])),
    min_size=2,
    max_size=3,
)


@pytest.mark.parametrize("prompts", PROMPT_SETS, ids=["short+long", "three lengths"])
def test_every_recipe_is_batch_invariant_on_fixed_prompts(fresh_tiny, prompts):
    model, tokenizer = fresh_tiny
    result = check(model, tokenizer, prompts)
    assert result["stable_rows"], "plain greedy must be batch-invariant for some row, or the test checks nothing"
    assert result["findings"] == []


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=prompt_sets)
def test_every_recipe_is_batch_invariant_on_drawn_prompts(fresh_tiny, prompts):
    model, tokenizer = fresh_tiny
    assert check(model, tokenizer, prompts)["findings"] == []


def test_the_grid_names_every_piece():
    names = {case.name for case in grid()}
    for piece in ("min-p per row", "beam none", "beam average", "beam gnmt", "kv budget", "kv ratio"):
        assert piece in names
    assert "beam gnmt + kv budget" in names and "all processors" in names


@pytest.mark.slow
def test_every_recipe_is_batch_invariant_on_the_default_model(real):
    model, tokenizer = real
    prompts = ["Name a color.", "Write a long, detailed story about a lighthouse keeper " * 6]
    result = check(model, tokenizer, prompts, steps=5)
    assert result["stable_rows"]
    assert result["findings"] == []
