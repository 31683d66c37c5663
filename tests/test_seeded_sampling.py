"""Per-row seeded sampling: draws follow softmax(scores) and do not depend on the batch."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit import GumbelSamplingLogitsProcessor, Strategy, encode_prompts


def test_draws_follow_the_softmax_of_the_scores():
    probabilities = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    scores = probabilities.log().expand(20_000, -1)
    sampler = GumbelSamplingLogitsProcessor(torch.arange(20_000), prompt_length=0)
    draws = sampler(torch.zeros(20_000, 3, dtype=torch.long), scores).argmax(dim=-1)
    frequencies = torch.bincount(draws, minlength=5).double() / 20_000
    # Each frequency is within 4 standard errors of its probability; the -inf token is never drawn.
    tolerance = 4 * (probabilities * (1 - probabilities) / 20_000).sqrt() + 1e-12
    assert bool(((frequencies - probabilities).abs() <= tolerance).all()), frequencies.tolist()
    assert frequencies[-1] == 0


def test_steps_and_seeds_give_independent_noise():
    sampler = GumbelSamplingLogitsProcessor([1, 2], prompt_length=2)
    scores = torch.zeros(2, 1000)
    first = sampler(torch.zeros(2, 2, dtype=torch.long), scores)
    second = sampler(torch.zeros(2, 3, dtype=torch.long), scores)
    assert not torch.equal(first, second) and not torch.equal(first[0], first[1])
    correlation = torch.corrcoef(torch.stack([first[0], first[1], second[0]]))
    assert bool((correlation.triu(1).abs() < 0.15).all())
    assert first.isfinite().all()


def test_a_row_draws_the_same_alone_or_in_a_batch_and_return_sequences_differ():
    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    batched = GumbelSamplingLogitsProcessor([5, 6, 7], prompt_length=0)(torch.zeros(3, 1, dtype=torch.long), scores)
    alone = GumbelSamplingLogitsProcessor([6], prompt_length=0)(torch.zeros(1, 1, dtype=torch.long), scores[1:2])
    assert torch.equal(batched[1], alone[0])
    one_request = GumbelSamplingLogitsProcessor([6], prompt_length=0)
    replicas = one_request(torch.zeros(4, 1, dtype=torch.long), scores[1:2].expand(4, -1))
    assert torch.equal(replicas[0], alone[0])  # the first return sequence is the request's own stream
    assert len({tuple(row.tolist()) for row in replicas}) == 4


@pytest.mark.parametrize("seeds", [[], [1.5], [[1, 2]], "x", [True]])
def test_bad_seeds_are_named(seeds):
    with pytest.raises(ValueError, match="seeds must be a 1-D sequence of integers"):
        GumbelSamplingLogitsProcessor(seeds, prompt_length=0)


def test_seeded_sampling_in_generate_equals_a_plain_seeded_loop(tiny):
    """Oracle: a loop without cache that applies temperature and top-p by hand, then the same noise."""
    from decodekit.logits_processors.seeded import gumbel_noise

    model, tokenizer = tiny
    strategy = Strategy(temperature=0.8, top_p=0.9)
    batch = encode_prompts(tokenizer, ["Tell me about the sea"])
    kwargs = strategy.generate_kwargs(model, attention_mask=batch["attention_mask"], row_seeds=[11])
    output = model.generate(**batch, max_new_tokens=10, pad_token_id=tokenizer.pad_token_id, **kwargs)
    ids = batch["input_ids"]
    width = ids.shape[1]
    for step in range(10):
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float() / 0.8
        probabilities = logits.softmax(dim=-1)
        ordered, order = probabilities.sort(dim=-1, descending=True)
        outside = ordered.cumsum(dim=-1) - ordered > 0.9  # mass before a token already reaches top_p
        logits[0, order[0][outside[0]]] = -math.inf
        noisy = logits + gumbel_noise(torch.tensor([11]), step, logits.shape[-1], logits.device)
        ids = torch.cat([ids, noisy.argmax(dim=-1, keepdim=True)], dim=1)
    assert torch.equal(output[0, width:], ids[0, width:])


# The bit patterns at the ends of the 32-bit range and of its halves; under 24-bit uniforms computed in
# float32, every pattern from 2**32 - 128 up rounded to a uniform of exactly 1.0 and an infinite noise.
EXTREME_BITS = [0, 1, 2, 255, 2**31 - 1, 2**31, 2**32 - 256, 2**32 - 129, 2**32 - 128, 2**32 - 2, 2**32 - 1]


def test_the_noise_is_finite_for_every_extreme_bit_pattern():
    from decodekit.logits_processors.seeded import gumbel_from_bits

    noise = gumbel_from_bits(torch.tensor(EXTREME_BITS))
    assert noise.dtype == torch.float32 and bool(noise.isfinite().all()), noise.tolist()
    assert bool((noise.diff() >= 0).all())  # larger uniforms, larger noise
    assert noise[0] == pytest.approx(-math.log(-math.log(0.5 / 2**32)), rel=1e-6)
    assert noise[-1] == pytest.approx(-math.log(0.5 / 2**32), rel=1e-6)  # -log(1 - u) for u next to 1
    # A filtered token (-inf) stays filtered under the largest noise: no NaN, never drawn.
    scores = torch.tensor([[-5.0, -math.inf]]) + noise[[0, -1]]
    assert scores.tolist() == [[pytest.approx(-5.0 + float(noise[0])), -math.inf]]


def test_uniform_draws_keep_32_bits_strictly_inside_the_unit_interval():
    from decodekit.logits_processors.seeded import uniform_draws, uniform_from_bits

    uniforms = uniform_from_bits(torch.tensor(EXTREME_BITS))
    assert bool(((uniforms > 0) & (uniforms < 1)).all())
    assert bool((uniforms.diff() > 0).all())  # neighbouring patterns stay apart: 32 bits survive
    draws = uniform_draws(torch.arange(10_000), 3, torch.device("cpu"))
    assert bool(((draws > 0) & (draws < 1)).all()) and abs(float(draws.mean()) - 0.5) < 0.02


def _share_of_patterns(condition, low: int = 0, high: int = 2**32) -> float:
    """The share of the 2**32 bit patterns where ``condition(noise)`` holds, for a condition that holds on
    one end of the range only (the noise is monotone in the bits): found by bisection."""
    from decodekit.logits_processors.seeded import gumbel_from_bits

    upper = condition(float(gumbel_from_bits(torch.tensor([2**32 - 1]))[0]))
    while low < high:  # the first pattern where the condition's truth matches the upper end
        middle = (low + high) // 2
        if condition(float(gumbel_from_bits(torch.tensor([middle]))[0])) == upper:
            high = middle
        else:
            low = middle + 1
    return (2**32 - low if upper else low) / 2**32


@pytest.mark.parametrize("gap", [5.0, 10.0, 15.0, 18.0, 20.0, 22.0])
def test_the_noise_tail_has_the_gumbel_mass_at_large_gaps(gap):
    """A token ``gap`` logits below another is drawn with probability about exp(-gap): the noise must exceed
    ``gap`` plus the other's noise that often, so its upper tail must hold exp(-gap) of the mass. 24-bit
    uniforms cap the noise near 17.3 (nothing beyond gap 17 is ever drawn) and round the tail to 2**-24."""
    upper = _share_of_patterns(lambda noise: noise > gap)
    exact = -math.expm1(-math.exp(-gap))
    assert abs(upper - exact) <= 2**-32 + 0.01 * exact, (upper, exact)
    lower = _share_of_patterns(lambda noise: noise < -math.log(gap))  # the lower tail, exp(-gap) as well
    exact_lower = math.exp(-gap)
    assert abs(lower - exact_lower) <= 2**-32 + 0.01 * exact_lower, (lower, exact_lower)
