"""FrequencyPresencePenaltyLogitsProcessor against the OpenAI formula, computed naively."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit import FrequencyPresencePenaltyLogitsProcessor
from tests.strategies_hypothesis import score_batches, token_histories

penalties = st.floats(-2.0, 2.0, allow_nan=False)


def naive(input_ids, scores, frequency, presence, prompt_length):
    out = scores.clone().double()
    for row in range(scores.shape[0]):
        generated = input_ids[row, prompt_length:].tolist()
        for token in set(generated):
            count = generated.count(token)
            out[row, token] -= count * frequency[row] + presence[row]
    return out.to(scores.dtype)


@settings(max_examples=200, deadline=None)
@given(scores=score_batches(max_vocab=24, dtypes=[torch.float32]), data=st.data(), prompt=st.integers(0, 20))
def test_equals_the_openai_formula(scores, data, prompt):
    rows = scores.shape[0]
    input_ids = data.draw(token_histories(rows, scores.shape[1]))
    frequency = data.draw(st.lists(penalties, min_size=rows, max_size=rows))
    presence = data.draw(st.lists(penalties, min_size=rows, max_size=rows))
    processor = FrequencyPresencePenaltyLogitsProcessor(frequency, presence, prompt_length=prompt)
    expected = naive(input_ids, scores, frequency, presence, prompt)
    torch.testing.assert_close(processor(input_ids, scores), expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=100, deadline=None)
@given(scores=score_batches(max_vocab=30), data=st.data(), frequency=penalties, presence=penalties)
def test_invariants_over_dtypes(scores, data, frequency, presence):
    input_ids = data.draw(token_histories(scores.shape[0], scores.shape[1]))
    out = FrequencyPresencePenaltyLogitsProcessor(frequency, presence, prompt_length=0)(input_ids, scores)
    assert out.dtype == scores.dtype and out.shape == scores.shape
    assert not torch.isnan(out).any()
    assert torch.equal(torch.isneginf(out), torch.isneginf(scores))


def test_hand_computed_case():
    input_ids = torch.tensor([[2, 2, 0, 0, 0, 1]])  # prompt [2, 2]; generated 0 x3, 1 x1
    out = FrequencyPresencePenaltyLogitsProcessor(0.5, 0.25, prompt_length=2)(input_ids, torch.zeros(1, 3))
    assert out.tolist() == [[-1.75, -0.75, 0.0]]


def test_nothing_generated_yet_changes_nothing():
    scores = torch.randn(2, 5)
    out = FrequencyPresencePenaltyLogitsProcessor(1.0, 1.0, prompt_length=3)(
        torch.zeros(2, 3, dtype=torch.long), scores
    )
    assert torch.equal(out, scores)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"frequency_penalty": 2.5, "prompt_length": 0}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"presence_penalty": -3, "prompt_length": 0}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": float("inf"), "prompt_length": 0}, "frequency_penalty must be in"),
        ({"frequency_penalty": 0.5, "prompt_length": -1}, "prompt_length must be an integer >= 0"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FrequencyPresencePenaltyLogitsProcessor(**kwargs)


def test_per_row_length_must_fit_the_batch():
    processor = FrequencyPresencePenaltyLogitsProcessor([0.1, 0.2, 0.3], prompt_length=0)
    with pytest.raises(ValueError, match="frequency_penalty has 3 per-row values but the scores have 4 rows"):
        processor(torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 5))
