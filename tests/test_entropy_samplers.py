"""Top-H, locally typical, epsilon and eta sampling against transformers' warpers (the oracles).

Each decodekit processor runs before generate's temperature, so it takes the temperature and is
compared with the warper applied to ``scores / temperature``; per-row parameters are compared row by
row with a warper built for that row's value.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import EpsilonLogitsWarper, EtaLogitsWarper, TypicalLogitsWarper
from transformers.generation.logits_process import TopHLogitsWarper

from decodekit import Strategy
from decodekit.logits_processors import (
    EpsilonLogitsProcessor,
    EtaLogitsProcessor,
    TopHLogitsProcessor,
    TypicalLogitsProcessor,
)

SAMPLERS = {
    "top_h": (TopHLogitsProcessor, lambda value: TopHLogitsWarper(value), [0.2, 0.5, 0.9, 0.95]),
    "typical_p": (TypicalLogitsProcessor, lambda value: TypicalLogitsWarper(value), [0.2, 0.5, 0.9, 0.95]),
    "epsilon_cutoff": (EpsilonLogitsProcessor, lambda value: EpsilonLogitsWarper(value), [1e-4, 1e-3, 0.01, 0.2]),
    "eta_cutoff": (EtaLogitsProcessor, lambda value: EtaLogitsWarper(value, device="cpu"), [1e-4, 1e-3, 0.01, 0.2]),
}


def _logits(rows: int = 4, vocab: int = 500, seed: int = 0, spread: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * spread


def _kept(scores: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(scores)


@pytest.mark.parametrize("name", list(SAMPLERS))
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_row_keeps_what_the_transformers_warper_keeps(name, temperature, seed):
    processor_class, warper_for, values = SAMPLERS[name]
    scores = _logits(seed=seed, spread=1.0 + seed)
    processed = processor_class(values, temperature=temperature)(None, scores)
    for row, value in enumerate(values):
        oracle = warper_for(value)(None, scores[row : row + 1] / temperature)
        assert torch.equal(_kept(processed[row : row + 1]), _kept(oracle)), (name, row, value)
    kept = _kept(processed)
    assert torch.equal(processed[kept], scores[kept])  # kept scores pass through bit for bit


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_one_value_equals_the_same_value_per_row(name):
    processor_class, _, values = SAMPLERS[name]
    scores = _logits(seed=5)
    per_row = processor_class(torch.full((4,), values[1]))(None, scores)
    assert torch.equal(per_row, processor_class(values[1])(None, scores))
    per_request = processor_class([values[0], values[2]])(None, scores)  # two requests of two rows each
    assert torch.equal(per_request[:2], processor_class(values[0])(None, scores[:2]))
    assert torch.equal(per_request[2:], processor_class(values[2])(None, scores[2:]))


@pytest.mark.parametrize("name", list(SAMPLERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_dtype_is_kept_and_no_row_is_emptied(name, dtype):
    processor_class, _, values = SAMPLERS[name]
    scores = _logits(seed=3).to(dtype)
    scores[0] = 0.0  # a flat row
    scores[1, 1:] = -math.inf  # a row an earlier filter left with one token
    scores[2, :] = -1e4  # a row of equal, very low logits
    processed = processor_class(values)(None, scores)
    assert processed.dtype == dtype
    assert _kept(processed).any(dim=-1).all()
    assert not torch.isnan(processed).any()
    assert _kept(processed)[1].tolist() == [True] + [False] * (scores.shape[1] - 1)


def test_top_h_of_one_keeps_every_candidate():
    """The whole entropy: all 100 likeliest tokens (where summation order may leave the warper one short)."""
    kept = _kept(TopHLogitsProcessor(1.0)(None, _logits(vocab=500)))
    assert kept.sum(dim=-1).tolist() == [100] * 4


def test_rows_do_not_depend_on_each_other():
    scores = _logits(rows=6, seed=4)
    for name, (processor_class, _, values) in SAMPLERS.items():
        together = processor_class(values[1])(None, scores)
        alone = torch.cat([processor_class(values[1])(None, scores[row : row + 1]) for row in range(6)])
        assert torch.equal(together, alone), name


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("top_h", 0.0, r"top_h must be (a number )?in \(0, 1\]"),
        ("top_h", 1.5, r"top_h must be (a number )?in \(0, 1\]"),
        ("typical_p", -0.1, r"typical_p must be (a number )?in \(0, 1\]"),
        ("epsilon_cutoff", 1.0, r"epsilon_cutoff must be (a number )?in \(0, 1\)"),
        ("eta_cutoff", 0.0, r"eta_cutoff must be (a number )?in \(0, 1\)"),
    ],
)
def test_bad_values_are_refused_by_name(name, bad, message):
    processor_class = SAMPLERS[name][0]
    with pytest.raises(ValueError, match=message):
        processor_class(bad)
    with pytest.raises(ValueError, match=message):
        Strategy(**{name: bad})


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_a_strategy_field_builds_the_processor_at_its_temperature(name, tiny):
    model, tokenizer = tiny
    processor_class, _, values = SAMPLERS[name]
    plan = Strategy(temperature=0.6, **{name: values[1]}).plan(model, tokenizer=tokenizer)
    (processor,) = [p for p in plan.processors if isinstance(p, processor_class)]
    assert processor.temperature.scalar == 0.6
    assert plan.sampling["do_sample"] is True
