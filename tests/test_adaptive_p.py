"""Adaptive-P against a loop written from llama.cpp's definition (``llama_sampler_adaptive_p_apply``)."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit import AdaptivePLogitsProcessor, Strategy, generate_text


class ReferenceAdaptiveP:
    """One row of llama.cpp's adaptive-p, in Python floats: the transform, then the average's update."""

    def __init__(self, target: float, decay: float):
        self.target, self.decay = target, decay
        self.weighted_sum, self.total_weight = target / (1 - decay), 1 / (1 - decay)
        self.probabilities: list[float] = []

    def logits(self, scores: list[float], temperature: float) -> list[float]:
        finite = [s / temperature for s in scores if s != -math.inf]
        top = max(finite)
        norm = sum(math.exp(s - top) for s in finite)
        self.probabilities = [0.0 if s == -math.inf else math.exp(s / temperature - top) / norm for s in scores]
        adapted = min(max(2 * self.target - self.weighted_sum / self.total_weight, 0.0), 1.0)
        out = []
        for score, p in zip(scores, self.probabilities, strict=True):
            d = abs(p - adapted) / 0.3
            out.append(-math.inf if score == -math.inf else 5.0 - 10.0 * d * d / (1.0 + d))
        return out

    def drew(self, token: int) -> None:
        self.weighted_sum = self.probabilities[token] + self.decay * self.weighted_sum
        self.total_weight = 1.0 + self.decay * self.total_weight


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_each_step_equals_the_reference_loop(temperature):
    generator = torch.Generator().manual_seed(0)
    targets, decays = [0.1, 0.3, 0.5, 0.9], [0.0, 0.5, 0.9, 0.99]
    processor = AdaptivePLogitsProcessor(targets, decays, temperature=temperature)
    references = [ReferenceAdaptiveP(t, d) for t, d in zip(targets, decays, strict=True)]
    input_ids = torch.zeros(4, 5, dtype=torch.long)
    for _ in range(6):
        scores = torch.randn(4, 40, generator=generator) * 2
        scores[:, 30:] = -math.inf  # removed by an earlier filter
        output = processor(input_ids, scores)
        for row, reference in enumerate(references):
            expected = torch.tensor(reference.logits(scores[row].tolist(), temperature))
            torch.testing.assert_close(output[row] / temperature, expected, rtol=1e-5, atol=1e-5)
        drawn = torch.multinomial((output / temperature).softmax(-1), 1, generator=generator)
        for row, reference in enumerate(references):
            reference.drew(int(drawn[row]))
        input_ids = torch.cat([input_ids, drawn], dim=1)
    assert torch.isneginf(output[:, 30:]).all() and torch.isfinite(output[:, :30]).all()


def test_a_run_of_likely_tokens_lowers_the_next_target():
    processor = AdaptivePLogitsProcessor(0.5, 0.5)
    scores = torch.log(torch.tensor([[0.9, 0.09, 0.01]]))
    first = processor(torch.zeros(1, 2, dtype=torch.long), scores).softmax(-1)
    second = processor(torch.zeros(1, 3, dtype=torch.long), scores).softmax(-1)  # token 0 (p = 0.9) was drawn
    assert second[0, 0] < first[0, 0]  # the likely token is now further from the (lowered) target


def test_a_new_generation_starts_over():
    processor = AdaptivePLogitsProcessor(0.5)
    scores = torch.log(torch.tensor([[0.9, 0.09, 0.01]]))
    first = processor(torch.zeros(1, 4, dtype=torch.long), scores)
    processor(torch.zeros(1, 5, dtype=torch.long), scores)
    assert torch.equal(processor(torch.zeros(1, 7, dtype=torch.long), scores), first)  # another prompt length


def test_the_dtype_is_kept_and_no_row_is_emptied():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        scores = torch.randn(3, 50).to(dtype)
        scores[1, 1:] = -math.inf
        output = AdaptivePLogitsProcessor(0.3)(torch.zeros(3, 2, dtype=torch.long), scores)
        assert output.dtype == dtype and torch.isfinite(output).any(dim=-1).all() and not output.isnan().any()


def test_bad_values_are_refused_by_name():
    with pytest.raises(ValueError, match=r"adaptive_p must be in \[0, 1\]"):
        AdaptivePLogitsProcessor(1.5)
    with pytest.raises(ValueError, match=r"adaptive_p_decay must be in \[0, 0.99\]"):
        AdaptivePLogitsProcessor(0.3, 1.0)
    with pytest.raises(ValueError, match="adaptive_p_decay applies to adaptive_p"):
        Strategy(adaptive_p_decay=0.5)


def test_generation_through_a_strategy_is_reproducible_and_batch_invariant(tiny):
    model, tokenizer = tiny
    strategy = Strategy(temperature=0.9, min_p=0.05, adaptive_p=0.4)
    prompts = ["Hello there", "Tell me a story about a cat"]
    batched = generate_text(model, tokenizer, prompts, strategy, max_new_tokens=12, row_seeds=[1, 2])
    alone = [generate_text(model, tokenizer, [p], strategy, max_new_tokens=12, row_seeds=[s])[0]
             for p, s in zip(prompts, [1, 2], strict=True)]  # fmt: skip
    assert batched == alone
