"""MinPLogitsProcessor against transformers' MinPLogitsWarper and hand-checked invariants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import MinPLogitsWarper

from decodekit import MinPLogitsProcessor
from tests.strategies_hypothesis import score_batches

# Values float32 can hold: the softmax-based oracle rounds min_p * p_max to 0 below ~1e-38.
min_ps = st.one_of(st.just(0.0), st.floats(1e-6, 1.0))


def _away_from_threshold(scores: torch.Tensor, min_p: float, temperature: float = 1.0) -> bool:
    """True when no token sits within rounding distance of the min-p boundary, where the
    softmax-based and the logit-based comparisons may round differently."""
    if min_p <= 0:
        return True
    finite = scores.double().masked_fill(~torch.isfinite(scores), -1e30)
    gap = finite - finite.amax(-1, keepdim=True) - temperature * math.log(min_p)
    return bool((gap.abs() > 1e-3).all())


def _kept_tokens_have_probability(scores: torch.Tensor, keep: int) -> bool:
    """True when the ``keep`` highest scores of every row have a non-zero float32 probability.

    Otherwise MinPLogitsWarper's ``min_tokens_to_keep`` ranks a finite token whose probability
    underflowed to 0 level with the -inf ones, and which of them it keeps is a tie-break; the
    case is pinned down by ``test_min_tokens_to_keep_counts_finite_scores_even_when_their_probability_underflows``.
    """
    probabilities = torch.softmax(scores, dim=-1)
    top = scores.topk(min(keep, scores.shape[-1]), dim=-1).indices
    kept = probabilities.gather(-1, top)
    return bool(((kept > 0) | ~torch.isfinite(scores.gather(-1, top))).all())


@settings(max_examples=200, deadline=None)
@given(scores=score_batches(dtypes=[torch.float32]), min_p=min_ps, keep=st.integers(1, 4))
def test_equals_transformers_min_p_at_temperature_one(scores, min_p, keep):
    assume(_away_from_threshold(scores, min_p))
    assume(_kept_tokens_have_probability(scores, keep))
    ours = MinPLogitsProcessor(min_p, min_tokens_to_keep=keep)(None, scores)
    theirs = MinPLogitsWarper(min_p, min_tokens_to_keep=keep)(None, scores)
    assert torch.equal(ours, theirs)


@settings(max_examples=150, deadline=None)
@given(scores=score_batches(dtypes=[torch.float32]), min_p=min_ps, temperature=st.floats(0.05, 5.0))
def test_temperature_judges_the_tempered_distribution(scores, min_p, temperature):
    assume(_away_from_threshold(scores, min_p, temperature))
    ours = MinPLogitsProcessor(min_p, temperature=temperature)(None, scores)
    tempered = MinPLogitsWarper(min_p)(None, scores / temperature)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(tempered))


@settings(max_examples=200, deadline=None)
@given(scores=score_batches(), min_p=min_ps, keep=st.integers(1, 6), temperature=st.floats(0.1, 3.0))
def test_invariants_over_dtypes(scores, min_p, keep, temperature):
    out = MinPLogitsProcessor(min_p, min_tokens_to_keep=keep, temperature=temperature)(None, scores)
    assert out.dtype == scores.dtype and out.shape == scores.shape
    assert not torch.isnan(out).any()
    kept = torch.isfinite(out)
    assert torch.equal(out[kept], scores[kept])  # kept scores are untouched
    assert not (kept & ~torch.isfinite(scores)).any()  # -inf stays -inf
    finite_per_row = torch.isfinite(scores).sum(-1)
    assert (kept.sum(-1) >= torch.clamp(finite_per_row, max=keep)).all()
    top = scores.argmax(-1, keepdim=True)
    assert kept.gather(1, top).all()  # the most likely token always survives


def test_hand_computed_case():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = MinPLogitsProcessor(0.2)(None, probs.log())  # threshold 0.1: drops 0.05 only
    assert torch.isfinite(out).tolist() == [[True, True, True, False]]
    out = MinPLogitsProcessor(0.2, temperature=0.5)(None, probs.log())
    # at T=0.5 the probabilities are proportional to p^2: 0.25, 0.09, 0.0225, 0.0025; threshold 0.05
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]


def test_min_p_one_keeps_every_token_tied_with_the_top():
    scores = torch.tensor([[2.0, 2.0, 1.999, float("-inf")]])
    out = MinPLogitsProcessor(1.0)(None, scores)
    assert out.tolist() == [[2.0, 2.0, float("-inf"), float("-inf")]]


def test_a_score_equal_to_a_zero_threshold_is_kept_whatever_the_sign_of_its_zero():
    # The threshold is top + ln(min_p) in float32; pick top so that it is exactly 0.
    min_p = 0.5
    top = -float(torch.tensor(math.log(min_p), dtype=torch.float32))
    scores = torch.tensor([[top, -0.0, 0.0, 1e-30, -1e-30, -1e-45]])
    out = MinPLogitsProcessor(min_p)(None, scores)
    expected_kept = [True, True, True, True, False, False]  # a naive comparison: score >= 0
    assert torch.isfinite(out)[0].tolist() == expected_kept
    assert torch.equal(out[0, :4], scores[0, :4]) and torch.signbit(out[0, 1]) and not torch.signbit(out[0, 2])


def test_kept_scores_come_back_bit_for_bit_in_every_float_dtype():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        scores = (torch.randn(3, 200, generator=torch.Generator().manual_seed(5)) * 5).to(dtype)
        out = MinPLogitsProcessor(0.05, min_tokens_to_keep=3, filter_value=-50.0)(None, scores)
        threshold = scores.float().amax(-1, keepdim=True) + math.log(0.05)
        kept = scores.float() >= threshold
        kept.scatter_(-1, scores.topk(3, dim=-1).indices, True)
        assert out.dtype == dtype
        assert torch.equal(out[kept], scores[kept])
        assert torch.equal(out[~kept], scores[~kept].clamp(max=-50.0))


def test_per_row_values_equal_one_processor_per_row():
    scores = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3
    values = torch.tensor([0.0, 0.05, 0.3, 1.0])
    batched = MinPLogitsProcessor(values)(None, scores)
    for row, value in enumerate(values.tolist()):
        assert torch.equal(batched[row], MinPLogitsProcessor(value)(None, scores[row : row + 1])[0])


def test_per_request_values_repeat_over_beams():
    scores = torch.randn(6, 30, generator=torch.Generator().manual_seed(2)) * 3
    out = MinPLogitsProcessor([0.1, 0.5])(None, scores)
    expected = MinPLogitsProcessor(torch.tensor([0.1, 0.1, 0.1, 0.5, 0.5, 0.5]))(None, scores)
    assert torch.equal(out, expected)


def test_per_row_length_must_fit_the_batch():
    with pytest.raises(ValueError, match="min_p has 2 per-row values but the scores have 3 rows"):
        MinPLogitsProcessor([0.1, 0.2])(None, torch.zeros(3, 10))


def test_finite_filter_value_never_raises_a_banned_token():
    scores = torch.tensor([[0.0, -1.0, -20.0, float("-inf")]])
    out = MinPLogitsProcessor(0.5, filter_value=-100.0)(None, scores)
    assert out.tolist() == [[0.0, -100.0, -100.0, float("-inf")]]


def test_an_infinite_top_score_keeps_its_row():
    scores = torch.tensor([[float("inf"), 1.0, 2.0], [float("-inf"), float("-inf"), 0.0]])
    for min_p in (0.0, 0.5, 1.0):
        out = MinPLogitsProcessor(min_p)(None, scores)
        assert not torch.isnan(out).any() and torch.isfinite(out).sum() + torch.isposinf(out).sum() >= 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"min_p": float("nan")}, "min_p must be in"),
        ({"min_p": [0.1, 2.0]}, "min_p must be in"),
        ({"min_p": torch.zeros(2, 2)}, "min_p as a tensor must be 1-D"),
        ({"min_p": 0.1, "min_tokens_to_keep": 0}, "min_tokens_to_keep must be an integer >= 1"),
        ({"min_p": 0.1, "temperature": 0.0}, r"temperature must be in \[1e-06, 10000\]"),
        ({"min_p": 0.1, "filter_value": float("nan")}, "filter_value must be a number"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MinPLogitsProcessor(**kwargs)


def test_bool_min_p_is_a_type_error():
    with pytest.raises(TypeError, match="min_p must be a number"):
        MinPLogitsProcessor(True)


def test_min_tokens_to_keep_counts_finite_scores_even_when_their_probability_underflows():
    # exp(-71 - 35.7) underflows to 0 in float32; it is still the third-best token, so keep=3 keeps it.
    scores = torch.tensor([[-32.5967, 35.6912, -71.0187, float("-inf"), float("-inf")]])
    kept = MinPLogitsProcessor(0.5, min_tokens_to_keep=3)(None, scores)
    assert torch.equal(torch.isfinite(kept), torch.tensor([[True, True, True, False, False]]))


def test_continuous_batching_support_follows_whether_values_are_per_row():
    assert MinPLogitsProcessor(0.1, temperature=0.7).supports_continuous_batching is True
    assert MinPLogitsProcessor([0.1, 0.2]).supports_continuous_batching is False
    assert MinPLogitsProcessor(0.1, temperature=[0.5, 1.0]).supports_continuous_batching is False
