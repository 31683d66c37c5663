"""p-less sampling against a loop written from the paper's definition (keep p >= sum of p squared)."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit import Strategy
from decodekit.logits_processors import PLessLogitsProcessor


def _logits(rows: int = 4, vocab: int = 300, seed: int = 0, spread: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * spread


def _paper_keeps(row: torch.Tensor, order: float, temperature: float) -> list[bool]:
    """One row, in float64, token by token: L = (sum p^q)^(1/(q-1)); keep p >= L."""
    probabilities = torch.softmax(row.double() / temperature, dim=-1).tolist()
    threshold = sum(p**order for p in probabilities) ** (1.0 / (order - 1.0))
    return [p >= threshold for p in probabilities]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_row_keeps_what_the_definition_keeps(temperature, seed):
    orders = [2.0, 1.5, 3.0, 8.0]
    scores = _logits(seed=seed, spread=0.5 + seed)
    processed = PLessLogitsProcessor(orders, temperature=temperature)(None, scores)
    for row, order in enumerate(orders):
        assert torch.isfinite(processed[row]).tolist() == _paper_keeps(scores[row], order, temperature), (row, order)
    kept = torch.isfinite(processed)
    assert torch.equal(processed[kept], scores[kept])


def test_the_threshold_is_the_collision_probability_by_hand():
    """p = (0.4, 0.35, 0.25): sum of squares 0.345, so 0.4 and 0.35 stay; at order 4 the threshold is
    (0.0256 + 0.0150 + 0.0039)^(1/3) = 0.354, so only 0.4 stays."""
    scores = torch.log(torch.tensor([[0.4, 0.35, 0.25]]))
    assert torch.isfinite(PLessLogitsProcessor(2.0)(None, scores)).tolist() == [[True, True, False]]
    assert torch.isfinite(PLessLogitsProcessor(4.0)(None, scores)).tolist() == [[True, False, False]]


def test_a_flatter_row_keeps_more_tokens_and_high_temperature_stays_truncated():
    scores = _logits(rows=1, seed=7, spread=1.0)
    counts = [int(torch.isfinite(PLessLogitsProcessor(2.0, temperature=t)(None, scores)).sum()) for t in (0.5, 1, 3)]
    assert counts[0] < counts[1] < counts[2] < scores.shape[1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_dtype_is_kept_and_a_flat_row_keeps_everything(dtype):
    scores = _logits(seed=3).to(dtype)
    scores[0] = 0.0  # flat: every p equals the threshold
    scores[1, 1:] = -math.inf  # one token left by an earlier filter
    scores[2, :] = -1e4
    processed = PLessLogitsProcessor(2.0)(None, scores)
    assert processed.dtype == dtype
    assert not torch.isnan(processed).any()
    kept = torch.isfinite(processed)
    assert kept[0].all() and kept[2].all()
    assert kept[1].tolist() == [True] + [False] * (scores.shape[1] - 1)
    assert kept.any(dim=-1).all()


def test_rows_do_not_depend_on_each_other_and_per_request_values_apply():
    scores = _logits(rows=4, seed=4)
    together = PLessLogitsProcessor([2.0, 4.0])(None, scores)
    assert torch.equal(together[:2], PLessLogitsProcessor(2.0)(None, scores[:2]))
    assert torch.equal(together[2:], PLessLogitsProcessor(4.0)(None, scores[2:]))
    alone = torch.cat([PLessLogitsProcessor(2.0)(None, scores[row : row + 1]) for row in range(4)])
    assert torch.equal(PLessLogitsProcessor(2.0)(None, scores), alone)


@pytest.mark.parametrize("bad", [1.0, 0.5, 65.0, math.nan])
def test_bad_orders_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"p_less must be (a number )?in \(1, 64\]"):
        PLessLogitsProcessor(bad)
    with pytest.raises(ValueError, match=r"p_less must be (a number )?in \(1, 64\]"):
        Strategy(p_less=bad)


def test_the_strategy_field_builds_the_processor_at_its_temperature(tiny):
    model, tokenizer = tiny
    plan = Strategy(temperature=1.5, p_less=2.0).plan(model, tokenizer=tokenizer)
    (processor,) = [p for p in plan.processors if isinstance(p, PLessLogitsProcessor)]
    assert processor.temperature.scalar == 1.5
    assert processor.order.scalar == 2.0
    assert plan.sampling["do_sample"] is True
