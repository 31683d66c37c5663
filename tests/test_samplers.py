"""DRY, XTC, top-nσ and Mirostat v2 against naive loops written from their published definitions."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
import torch

from decodekit import (
    DRYLogitsProcessor,
    MinKLogitsProcessor,
    MirostatLogitsProcessor,
    TopNSigmaLogitsProcessor,
    XTCLogitsProcessor,
)
from decodekit.logits_processors.seeded import uniform_draws

BREAKERS = {3, 4}


def _repetitive_ids(rows: int, length: int, seed: int) -> torch.Tensor:
    """Token ids from a tiny vocabulary with copied stretches, so long matches occur."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 12, (rows, length), generator=generator)
    for row in range(rows):
        start = int(torch.randint(0, length // 2, (1,), generator=generator))
        span = int(torch.randint(2, length // 2, (1,), generator=generator))
        copy = ids[row, start : start + span].clone()
        ids[row, length - span :] = copy[:span]
    return ids


def dry_reference(ids: list[int], vocab: int, multiplier, base, allowed, breakers, last_n) -> list[float]:
    """text-generation-webui's DRY, transcribed as a plain loop over one row."""
    ids = ids[-last_n:]
    penalties = [0.0] * vocab
    last = ids[-1]
    if last in breakers:
        return penalties
    lengths: dict[int, int] = {}
    for index, token in enumerate(ids[:-1]):
        if token != last:
            continue
        following = ids[index + 1]
        if following in breakers:
            continue
        length = 1
        while length < 50:
            earlier = index - length
            if earlier < 0:
                break
            previous = ids[-(length + 1)]
            if ids[earlier] != previous or previous in breakers:
                break
            length += 1
        lengths[following] = max(length, lengths.get(following, 0))
    for token, length in lengths.items():
        if length >= allowed and token < vocab:
            penalties[token] = multiplier * base ** (length - allowed)
    return penalties


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("allowed", "last_n"), [(2, 64), (1, 16), (3, 7)])
def test_dry_matches_the_reference_loop(seed, allowed, last_n):
    ids = _repetitive_ids(3, 40, seed)
    scores = torch.randn(3, 16, generator=torch.Generator().manual_seed(seed))
    processor = DRYLogitsProcessor(0.8, 1.75, allowed, sequence_breaker_ids=sorted(BREAKERS), penalty_last_n=last_n)
    out = processor(ids, scores)
    for row in range(3):
        penalty = dry_reference(ids[row].tolist(), 16, 0.8, 1.75, allowed, BREAKERS, last_n)
        assert out[row].tolist() == pytest.approx((scores[row] - torch.tensor(penalty)).tolist(), rel=1e-6)


def test_dry_caps_matches_at_fifty_tokens_and_keeps_the_dtype():
    ids = torch.tensor([[7] * 120])  # a run of one token: every match is as long as the window allows
    processor = DRYLogitsProcessor(1.0, 1.1, 2, penalty_last_n=200)
    out = processor(ids, torch.zeros(1, 10, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert out[0, 7].item() == pytest.approx(-(1.1**48), rel=1e-2) and out[0, 6].item() == 0


def xtc_reference(scores: list[float], threshold, probability, temperature, draw) -> list[float]:
    """The XTC rule for one row: remove every top choice except the least likely one."""
    if draw >= probability:
        return scores
    exps = [math.exp(s / temperature) if s != -math.inf else 0.0 for s in scores]
    total = sum(exps)
    probabilities = [e / total for e in exps]
    tops = [token for token, p in enumerate(probabilities) if p >= threshold]
    if len(tops) < 2:
        return scores
    least = min(probabilities[token] for token in tops)
    return [-math.inf if token in tops and probabilities[token] > least else s for token, s in enumerate(scores)]


@pytest.mark.parametrize("seed", range(8))
def test_xtc_matches_the_reference_rule(seed):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(6, 12, generator=generator) * 2
    thresholds = torch.linspace(0.05, 0.3, 6)
    processor = XTCLogitsProcessor(thresholds, 0.6, temperature=0.8, seeds=list(range(10, 16)), prompt_length=3)
    input_ids = torch.zeros(6, 3 + seed, dtype=torch.long)
    out = processor(input_ids, scores)
    draws = uniform_draws(torch.arange(10, 16), seed, torch.device("cpu"), 2)
    for row in range(6):
        expected = xtc_reference(scores[row].tolist(), float(thresholds[row]), 0.6, 0.8, float(draws[row]))
        assert out[row].tolist() == pytest.approx(expected)


def test_xtc_acts_on_about_the_share_of_rows_its_probability_says():
    scores = torch.tensor([[2.0, 1.5, 0.0, -1.0]]).repeat(2000, 1)  # two top choices (p 0.56, 0.34) per row
    out = XTCLogitsProcessor(0.2, 0.3, seeds=list(range(2000)))(torch.zeros(2000, 1, dtype=torch.long), scores)
    acted = (out != scores).any(dim=1).float().mean().item()
    assert 0.26 < acted < 0.34  # 0.3 within about four standard deviations
    assert torch.equal(out.isinf().any(dim=1), out[:, 0].isinf())  # only the likelier top choice ever goes


def test_xtc_rows_flip_the_same_coins_alone_or_in_a_batch():
    scores = torch.randn(4, 20, generator=torch.Generator().manual_seed(0))
    batch = XTCLogitsProcessor(0.05, 0.5, seeds=[1, 2, 3, 4])(torch.zeros(4, 5, dtype=torch.long), scores)
    alone = XTCLogitsProcessor(0.05, 0.5, seeds=[3])(torch.zeros(1, 5, dtype=torch.long), scores[2:3])
    assert torch.equal(batch[2:3], alone)


def top_n_sigma_reference(scores: list[float], n: float) -> list[float]:
    finite = [s for s in scores if math.isfinite(s)]
    threshold = max(finite) - n * statistics.stdev(finite)
    return [s if s >= threshold else -math.inf for s in scores]


@pytest.mark.parametrize("seed", range(5))
def test_top_n_sigma_matches_the_reference_and_is_temperature_invariant(seed):
    scores = torch.randn(4, 50, generator=torch.Generator().manual_seed(seed)) * 3
    scores[0, :10] = -math.inf  # removed by an earlier filter: not part of the statistics
    n = torch.tensor([0.5, 1.0, 1.5, 3.0])
    out = TopNSigmaLogitsProcessor(n)(None, scores)
    for row in range(4):
        assert out[row].tolist() == pytest.approx(top_n_sigma_reference(scores[row].tolist(), float(n[row])))
    kept = out.isfinite()
    for temperature in (0.3, 2.0):
        assert torch.equal(TopNSigmaLogitsProcessor(n)(None, scores / temperature).isfinite(), kept)
    assert kept.any(dim=1).all()


def mirostat_reference(steps: list[list[float]], drawn: list[int], tau: float, eta: float) -> list[list[bool]]:
    """Mirostat 2 for one row, step by step: which tokens each step keeps."""
    mu, masks = 2 * tau, []
    for index, scores in enumerate(steps):
        total = sum(math.exp(s) for s in scores)
        surprise = [-math.log2(math.exp(s) / total) for s in scores]
        best = min(surprise)
        keep = [value <= mu or value == best for value in surprise]
        masks.append(keep)
        kept_total = sum(math.exp(s) for s, k in zip(scores, keep, strict=True) if k)
        observed = -math.log2(math.exp(scores[drawn[index]]) / kept_total)
        mu -= eta * (observed - tau)
    return masks


def test_mirostat_matches_the_reference_over_steps():
    generator = torch.Generator().manual_seed(0)
    rows, steps, prompt = 3, 12, 4
    processor = MirostatLogitsProcessor(torch.tensor([2.0, 3.0, 4.0]), 0.2)
    ids = torch.zeros(rows, prompt, dtype=torch.long)
    history, drawn, masks = [], [], []
    for _ in range(steps):
        scores = torch.randn(rows, 30, generator=generator) * 2
        out = processor(ids, scores)
        masks.append(out.isfinite())
        # draw a kept token per row, as the sampler would, and append it
        choice = torch.multinomial(torch.softmax(out, dim=-1), 1, generator=generator)
        history.append(scores)
        drawn.append(choice[:, 0])
        ids = torch.cat([ids, choice], dim=1)
    for row, tau in enumerate((2.0, 3.0, 4.0)):
        expected = mirostat_reference([step[row].tolist() for step in history], [int(d[row]) for d in drawn], tau, 0.2)
        assert [mask[row].tolist() for mask in masks] == expected


def test_mirostat_starts_over_for_a_new_generation():
    processor = MirostatLogitsProcessor(1.0, 0.5)
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    first = processor(torch.zeros(1, 3, dtype=torch.long), scores)
    processor(torch.tensor([[0, 0, 0, 3]]), scores)  # drew a very surprising token: mu moves
    assert not torch.equal(processor.mu, torch.tensor([[2.0]]))
    again = processor(torch.zeros(1, 3, dtype=torch.long), scores)  # a new prompt: mu = 2 * tau again
    assert torch.equal(again.isfinite(), first.isfinite()) and torch.equal(processor.mu, torch.tensor([[2.0]]))


@pytest.mark.parametrize(
    "processor",
    [
        DRYLogitsProcessor(2.0, sequence_breaker_ids=[3]),
        XTCLogitsProcessor(0.01, 1.0),
        TopNSigmaLogitsProcessor(0.0),
        MirostatLogitsProcessor(0.1),
        MinKLogitsProcessor(1.0),
    ],
    ids=lambda processor: type(processor).__name__,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_never_nan_never_an_empty_row_dtype_kept(processor, dtype):
    scores = torch.randn(5, 40, generator=torch.Generator().manual_seed(1)).to(dtype) * 5
    scores[0] = 0.0  # all tied
    scores[1, 5:] = -math.inf  # mostly removed already
    ids = _repetitive_ids(5, 30, 2)
    out = processor(ids, scores)
    assert out.dtype == dtype and not out.isnan().any() and out.isfinite().any(dim=1).all()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: DRYLogitsProcessor(0.0), r"dry_multiplier must be a number in \(0, 100\]"),
        (lambda: DRYLogitsProcessor(1.0, base=0.5), r"dry_base must be a number in \[1, 10\]"),
        (lambda: DRYLogitsProcessor(1.0, allowed_length=0), "dry_allowed_length must be an integer"),
        (lambda: XTCLogitsProcessor(1.5, 0.5), r"xtc_threshold must be in \[0, 1\]"),
        (lambda: XTCLogitsProcessor(0.1, True), "xtc_probability must be a number"),
        (lambda: TopNSigmaLogitsProcessor(-1), r"top_n_sigma must be in \[0, 10000\]"),
        (lambda: MirostatLogitsProcessor(0.0), r"mirostat_tau must be in \(0, 64\]"),
        (lambda: MirostatLogitsProcessor(5.0, eta=2.0), r"mirostat_eta must be in \(0, 1\]"),
    ],
)
def test_bad_arguments_are_named(build, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build()


SAMPLER_RECIPES = {
    "dry": {"dry_multiplier": 0.8, "dry_allowed_length": 2},
    "xtc": {"temperature": 1.0, "xtc_threshold": 0.05, "xtc_probability": 0.5},
    "top-n-sigma": {"temperature": 1.5, "top_n_sigma": 1.0},
    "min-k": {"temperature": 1.5, "min_k": 1.0},
    "mirostat": {"temperature": 1.0, "mirostat_tau": 3.0, "mirostat_eta": 0.1},
}


@pytest.mark.parametrize("recipe", list(SAMPLER_RECIPES))
def test_each_sampler_reaches_generate_through_a_strategy(tiny, recipe):
    from decodekit import Strategy, generate_text

    model, tokenizer = tiny
    strategy = Strategy(**SAMPLER_RECIPES[recipe])
    prompts = ["Hello there", "Tell me about the sea and the sky"]
    texts = generate_text(model, tokenizer, prompts, strategy, max_new_tokens=12, row_seeds=[1, 2])
    assert len(texts) == 2 and all(isinstance(text, str) for text in texts)
    # Batch invariance: each prompt gets what it gets alone.
    alone = [generate_text(model, tokenizer, [p], strategy, max_new_tokens=12, row_seeds=[s])[0]
             for p, s in zip(prompts, [1, 2], strict=True)]  # fmt: skip
    assert texts == alone


def test_dry_changes_greedy_text_that_repeats(tiny):
    from decodekit import Strategy, encode_prompts

    model, tokenizer = tiny
    batch = encode_prompts(tokenizer, ["Hello"])
    plain = model.generate(**batch, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    kwargs = Strategy(dry_multiplier=5.0, dry_allowed_length=1).generate_kwargs(
        model, tokenizer=tokenizer, attention_mask=batch["attention_mask"]
    )
    dried = model.generate(**batch, max_new_tokens=40, pad_token_id=tokenizer.pad_token_id, **kwargs)
    prompt = batch["input_ids"].shape[1]
    repeated = plain[0, prompt:].tolist()
    assert len(set(itertools.pairwise(repeated))) < len(repeated) - 1  # the tiny model loops
    assert dried[0, prompt:].tolist() != repeated


def test_mirostat_is_refused_with_beams_and_dry_needs_the_tokenizer():
    from decodekit import Strategy

    with pytest.raises(ValueError, match="does not sample: drop mirostat_tau"):
        Strategy(num_beams=2, mirostat_tau=5.0)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        Strategy(dry_multiplier=0.8).generate_kwargs(prompt_length=3)
    with pytest.raises(ValueError, match="dry_base applies to dry_multiplier"):
        Strategy(dry_base=1.5)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(SAMPLER_RECIPES))
def test_each_sampler_generates_on_the_default_model(real, recipe):
    from decodekit import Strategy, generate_text

    model, tokenizer = real
    texts = generate_text(model, tokenizer, ["Write a haiku about the sea."], Strategy(**SAMPLER_RECIPES[recipe]),
                          max_new_tokens=24, row_seeds=[0])  # fmt: skip
    assert texts[0].strip()
