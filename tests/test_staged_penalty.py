"""StagedRepetitionPenaltyLogitsProcessor against a naive loop, hand-computed cases and transformers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

from decodekit import StagedRepetitionPenaltyLogitsProcessor
from decodekit.logits_processors import parse_stages
from tests.strategies_hypothesis import score_batches, token_histories

STAGES = {1: 1.2, 3: 1.5, 6: 2.0}


def naive_staged(input_ids, scores, table, window=None, uncounted=(), counted_from=0):
    """The definition, one token at a time."""
    out = scores.clone()
    for row in range(scores.shape[0]):
        history = input_ids[row].tolist()
        positions = range(len(history)) if window is None else range(max(len(history) - window, 0), len(history))
        counts: dict[int, int] = {}
        for position in positions:
            token = history[position]
            if position >= counted_from and token not in uncounted:
                counts[token] = counts.get(token, 0) + 1
        for token, count in counts.items():
            penalty = 1.0
            for threshold, value in sorted(table.items()):
                if count >= threshold:
                    penalty = value
            value = scores[row, token].item()
            out[row, token] = value * penalty if value < 0 else value / penalty
    return out


@st.composite
def cases(draw):
    scores = draw(score_batches(max_vocab=24, dtypes=[torch.float32]))
    input_ids = draw(token_histories(scores.shape[0], scores.shape[1]))
    thresholds = sorted(draw(st.sets(st.integers(1, 8), min_size=1, max_size=4)))
    penalties = sorted(draw(st.lists(st.floats(0.5, 4.0), min_size=len(thresholds), max_size=len(thresholds))))
    window = draw(st.one_of(st.none(), st.integers(1, 45)))
    return scores, input_ids, dict(zip(thresholds, penalties, strict=True)), window


@settings(max_examples=200, deadline=None)
@given(
    case=cases(), exempt=st.sets(st.integers(0, 23), max_size=3), count_prompt=st.booleans(), prompt=st.integers(0, 40)
)
def test_equals_the_naive_definition(case, exempt, count_prompt, prompt):
    scores, input_ids, table, window = case
    processor = StagedRepetitionPenaltyLogitsProcessor(
        table, window=window, exempt_token_ids=exempt, count_prompt=count_prompt, prompt_length=prompt
    )
    expected = naive_staged(input_ids, scores, table, window, exempt, 0 if count_prompt else prompt)
    torch.testing.assert_close(processor(input_ids, scores), expected, rtol=1e-6, atol=0)


@settings(max_examples=100, deadline=None)
@given(scores=score_batches(max_vocab=30), data=st.data(), penalty=st.floats(0.5, 3.0))
def test_single_stage_whole_sequence_equals_transformers_repetition_penalty(scores, data, penalty):
    input_ids = data.draw(token_histories(scores.shape[0], scores.shape[1]))
    ours = StagedRepetitionPenaltyLogitsProcessor({1: penalty})(input_ids, scores)
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, scores)
    assert torch.equal(ours, theirs)


@settings(max_examples=100, deadline=None)
@given(scores=score_batches(max_vocab=30), data=st.data())
def test_invariants_over_dtypes(scores, data):
    input_ids = data.draw(token_histories(scores.shape[0], scores.shape[1]))
    out = StagedRepetitionPenaltyLogitsProcessor(STAGES, window=16)(input_ids, scores)
    assert out.dtype == scores.dtype and out.shape == scores.shape
    assert not torch.isnan(out).any()
    assert torch.equal(torch.isneginf(out), torch.isneginf(scores))
    assert (out <= scores).all()  # penalties >= 1 never raise a score


def test_hand_computed_stages():
    # token 0 once, token 1 three times, token 2 six times, token 3 never
    input_ids = torch.tensor([[0, 1, 1, 1, 2, 2, 2, 2, 2, 2]])
    scores = torch.tensor([[3.0, -3.0, 3.0, 3.0]])
    out = StagedRepetitionPenaltyLogitsProcessor(STAGES)(input_ids, scores)
    torch.testing.assert_close(out, torch.tensor([[3.0 / 1.2, -3.0 * 1.5, 3.0 / 2.0, 3.0]]))


def test_window_counts_only_recent_tokens():
    input_ids = torch.tensor([[1, 1, 1, 1, 1, 0, 0]])
    scores = torch.tensor([[2.0, 2.0]])
    out = StagedRepetitionPenaltyLogitsProcessor({1: 2.0, 3: 4.0}, window=3)(input_ids, scores)
    # the window is [1, 0, 0]: token 1 once (2.0), token 0 twice (still the first stage)
    assert out.tolist() == [[1.0, 1.0]]


def test_left_padding_never_counts_but_later_occurrences_of_the_pad_id_do():
    # Row 0: three pads, then 4 5 and a real 9 (a chat separator that is also the pad token).
    input_ids = torch.tensor([[9, 9, 9, 4, 5, 9], [4, 5, 6, 7, 8, 9]])
    scores = torch.full((2, 10), 2.0)
    by_id = StagedRepetitionPenaltyLogitsProcessor({1: 2.0, 2: 4.0}, pad_token_id=9)(input_ids, scores)
    by_length = StagedRepetitionPenaltyLogitsProcessor({1: 2.0, 2: 4.0}, padding_lengths=[3, 0])(input_ids, scores)
    for out in (by_id, by_length):
        assert out[0, 9] == 1.0  # counted once (the real occurrence), not four times
        assert out[0, 4] == 1.0 and out[1, 4] == 1.0 and out[1, 9] == 1.0


def test_padding_lengths_are_given_per_request_under_beams():
    input_ids = torch.tensor([[0, 3, 3], [0, 3, 3], [0, 0, 3], [0, 0, 3]])  # two requests x two beams
    scores = torch.full((4, 4), 2.0)
    out = StagedRepetitionPenaltyLogitsProcessor({1: 2.0, 2: 4.0}, padding_lengths=[1, 2])(input_ids, scores)
    assert out[:, 0].tolist() == [2.0, 2.0, 2.0, 2.0]
    assert out[:, 3].tolist() == [0.5, 0.5, 1.0, 1.0]


@pytest.mark.parametrize("bad", [[1.5], [[1, 2]], [-1], [True], "ab", []])
def test_bad_padding_lengths_are_named(bad):
    with pytest.raises(ValueError, match="padding_lengths must be a 1-D sequence of integers >= 0"):
        StagedRepetitionPenaltyLogitsProcessor({1: 2.0}, padding_lengths=bad)


def test_prompt_tokens_can_be_left_out():
    input_ids = torch.tensor([[3, 3, 3, 1]])  # prompt [3, 3, 3], generated [1]
    scores = torch.full((1, 4), 2.0)
    out = StagedRepetitionPenaltyLogitsProcessor({1: 2.0}, count_prompt=False, prompt_length=3)(input_ids, scores)
    assert out.tolist() == [[2.0, 1.0, 2.0, 2.0]]


def test_per_row_tables_equal_one_processor_per_row():
    input_ids = torch.tensor([[1, 1, 2], [1, 2, 2]])
    scores = torch.full((2, 3), 4.0)
    tables = [{1: 2.0}, {2: 4.0}]
    out = StagedRepetitionPenaltyLogitsProcessor(tables)(input_ids, scores)
    for row, table in enumerate(tables):
        single = StagedRepetitionPenaltyLogitsProcessor(table)(input_ids[row : row + 1], scores[row : row + 1])
        assert torch.equal(out[row], single[0])


def test_per_row_tables_must_fit_the_batch():
    with pytest.raises(ValueError, match="stages has 2 per-row values but the scores have 3 rows"):
        StagedRepetitionPenaltyLogitsProcessor([{1: 2.0}, {1: 3.0}])(
            torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 5)
        )


def test_ids_beyond_the_output_vocabulary_are_ignored():
    input_ids = torch.tensor([[7, 1]])  # 7 exists in a larger embedding, not in the 4 scores
    out = StagedRepetitionPenaltyLogitsProcessor({1: 2.0})(input_ids, torch.full((1, 4), 2.0))
    assert out.tolist() == [[2.0, 1.0, 2.0, 2.0]]


def test_parse_stages_round_trip_and_errors():
    assert parse_stages("1:1.2,3:1.5,6:2.0") == STAGES
    for bad in ["", "1=1.2", "x:1.2", "1:1.2,1:1.3", "3:1.5,1:1.2", "1:0", "1:-1", "0:1.5", "1:1.5,2:1.2"]:
        with pytest.raises(ValueError, match="stages"):
            parse_stages(bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stages": {3: 1.5, 1: 1.2}}, "counts must be strictly increasing"),
        ({"stages": {1: 1.5, 3: 1.2}}, "penalties must not decrease"),
        ({"stages": {1: 0.0}}, "every penalty must be a finite number > 0"),
        ({"stages": {1: -1.2}}, "every penalty must be a finite number > 0"),
        ({"stages": {0: 1.2}}, "every count must be an integer >= 1"),
        ({"stages": {}}, "non-empty mapping"),
        ({"stages": [{1: 1.2}, {2: 0.5, 1: 1.0}]}, r"stages\[1\]: counts must be strictly increasing"),
        ({"stages": STAGES, "window": 0}, "window must be an integer >= 1"),
        ({"stages": STAGES, "count_prompt": False}, "count_prompt=False needs prompt_length"),
        ({"stages": STAGES, "exempt_token_ids": [-1]}, "exempt_token_ids must hold token ids"),
        ({"stages": STAGES, "prompt_length": -2}, "prompt_length must be an integer >= 0"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StagedRepetitionPenaltyLogitsProcessor(**kwargs)


def test_punctuation_token_ids_are_exactly_the_punctuation_tokens(tiny):
    import string

    from decodekit.logits_processors import punctuation_token_ids

    _, tokenizer = tiny
    ids = punctuation_token_ids(tokenizer)
    allowed = set(string.punctuation + string.whitespace)
    assert all(set(tokenizer.decode([i])) <= allowed for i in ids)
    assert tokenizer.convert_tokens_to_ids(".") in ids and tokenizer.convert_tokens_to_ids(",") in ids
    letters = tokenizer.convert_tokens_to_ids("a")
    assert letters not in ids
