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
