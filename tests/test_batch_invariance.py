"""Batch invariance as a property: every recipe gives a prompt the same result alone or in a padded batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from decodekit import CompressedCache, Strategy, encode_prompts
from tests.batch_invariance import Case, check, grid, strategy_case
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
@example(prompts=["The", _prompt(27423, 40)])  # typical-p's threshold between two tokens 1e-6 apart
def test_every_recipe_is_batch_invariant_on_drawn_prompts(fresh_tiny, prompts):
    model, tokenizer = fresh_tiny
    assert check(model, tokenizer, prompts)["findings"] == []


def _cache_case(name: str, **options) -> Case:
    """Greedy decoding with a fresh ``CompressedCache(model, **options)`` per generate call."""

    def build(model, batch, rows):
        return {"do_sample": False, "past_key_values": CompressedCache(model, **options)}

    return Case(name, build)


# Budgets from the floor (sink_tokens + recent_tokens = 36) up, with interval eviction: rows of 47 and 51
# tokens cross budgets 52 and 56 while decoding, on different steps, while the 91-token row evicts from
# its prefill on; at 36 and 40 every row evicts straight down to the floor.
CACHE_EDGES = [
    _cache_case(f"budget {budget}, interval {interval}", budget=budget, eviction_interval=interval)
    for budget, interval in [(36, 8), (37, 8), (40, 8), (52, 8), (56, 8), (52, 3), (52, 1), (56, 2)]
] + [
    _cache_case(f"ratio {ratio}, interval {interval}", compression_ratio=ratio, eviction_interval=interval)
    for ratio, interval in [(0.1, 8), (0.5, 8), (0.9, 8), (0.5, 1)]
]


def test_the_cache_is_batch_invariant_at_budgets_down_to_the_floor(fresh_tiny):
    model, tokenizer = fresh_tiny
    prompts = [_prompt(300, 1), _prompt(300, 3), _prompt(300, 15)]
    assert [encode_prompts(tokenizer, [p])["input_ids"].shape[1] for p in prompts] == [47, 51, 91]
    result = check(model, tokenizer, prompts, CACHE_EDGES, steps=16)
    assert len(result["stable_rows"]) >= 2
    assert result["findings"] == []


def test_the_grid_names_every_piece():
    names = {case.name for case in grid()}
    for piece in ("min-p per row", "beam none", "beam average", "beam gnmt", "kv budget", "kv ratio"):
        assert piece in names
    assert "beam gnmt + kv budget" in names and "all processors" in names


@pytest.mark.slow
def test_every_recipe_is_batch_invariant_on_the_default_model(real):
    model, tokenizer = real
    prompts = ["Name a color.", "Write a long, detailed story about a lighthouse keeper " * 6]
    result = check(model, tokenizer, prompts, steps=3)  # the tiny models' tests decode longer
    assert result["stable_rows"]
    assert result["findings"] == []


@pytest.mark.slow
def test_the_cache_near_its_floor_is_batch_invariant_on_the_default_model(real):
    """A short prompt crosses a budget near the floor while a longer one evicts from its prefill on."""
    model, tokenizer = real
    prompts = [
        "Name a color.",
        "Write a detailed paragraph about the history of the printing press in Europe, its inventors, and its "
        "effects on literacy, religion and science in the following two centuries.",
        "List three fruits and say which one is the sweetest, and explain why in one sentence.",
    ]
    cases = [
        strategy_case("kv budget 40", Strategy(kv_budget=40)),
        strategy_case("kv budget 48", Strategy(kv_budget=48)),
        strategy_case("kv budget 40 + staged penalty", Strategy(kv_budget=40, staged_penalty="1:1.2,3:1.5")),
    ]
    result = check(model, tokenizer, prompts, cases, steps=12)
    assert len(result["stable_rows"]) == 3
    assert result["findings"] == []


class _BatchSizeBias:
    """A processor that is not batch-invariant on purpose: it raises token ``10 + batch size`` far above the rest."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, 10 + input_ids.shape[0]] += 1e4
        return scores


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy recipe", "sampling recipe"])
def test_the_harness_flags_a_recipe_that_depends_on_the_batch(fresh_tiny, sampling):
    """Both paths of the harness (a greedy recipe's scores read from its greedy run, a sampling recipe's from a run
    of its own) find the scores and the tokens that differ."""
    from transformers import LogitsProcessorList

    def build(model, batch, rows):
        kwargs = {"do_sample": sampling, "logits_processor": LogitsProcessorList([_BatchSizeBias()])}
        return {**kwargs, "temperature": 0.9, "top_k": 0, "top_p": 1.0} if sampling else kwargs

    model, tokenizer = fresh_tiny
    result = check(model, tokenizer, PROMPT_SETS[0], [Case("biased", build)], steps=2)
    assert result["stable_rows"]
    found = {(finding.row, finding.what) for finding in result["findings"]}
    for row in result["stable_rows"]:
        assert {(row, "first-step scores differ"), (row, "greedy tokens differ")} <= found


def test_the_harness_forgives_one_token_across_a_threshold_only_where_the_model_itself_was_noisy():
    from tests.batch_invariance import _close

    inf = float("-inf")
    batched = torch.tensor([1.0, 2.0, inf, inf, inf])
    one_flip = torch.tensor([1.0, 2.0, 0.5, inf, inf])  # a near tie fell the other way
    two_flips = torch.tensor([1.0, 2.0, 0.5, 0.4, inf])
    moved = torch.tensor([1.0, 2.5, inf, inf, inf])
    assert _close(batched, batched.clone()) and _close(batched, batched.clone(), noisy=True)
    assert not _close(batched, one_flip) and _close(batched, one_flip, noisy=True)
    assert not _close(batched, two_flips, noisy=True)
    assert not _close(batched, moved, noisy=True)
