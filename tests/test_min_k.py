"""Min-k against a loop written from its published description (arXiv 2604.11012, as vLLM #48142 describes it):
sort the finite logits, divide each drop between neighbours by the logit range and by its rank to the power
``exponent``, cut at the first best drop, keep every logit at or above it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from decodekit import Strategy
from decodekit.logits_processors import MinKLogitsProcessor
from decodekit.logits_processors.min_k import (
    CERTIFIED_FROM_VOCAB,
    STAGES,
    certified_threshold,
    histogram_bound,
    sorted_threshold,
)

EXPONENTS = (0.0, 0.5, 1.0, 1.5, 2.0, 4.0)


def paper_keeps(row: torch.Tensor, exponent: float) -> list[bool]:
    """One row, token by token in float64: the kept set by the description."""
    values = [float(v) for v in row.double().tolist()]
    ordered = sorted((v for v in values if v > -math.inf), reverse=True)
    if not ordered:
        return [False] * len(values)
    spread = ordered[0] - ordered[-1]
    if spread == 0:  # every drop is 0: the cut after the first token keeps its ties, all of them
        return [v > -math.inf for v in values]
    best, cut = -1.0, 0
    for rank in range(1, len(ordered)):
        score = (ordered[rank - 1] - ordered[rank]) / (spread * rank**exponent)
        if score > best:
            best, cut = score, rank - 1
    return [v >= ordered[cut] for v in values]


def random_rows(generator: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Rows of several shapes: spread logits, small integer grids (ties), plateaus, removed tokens (-inf),
    one finite token, a constant row."""
    kinds = torch.randint(0, 7, (rows,), generator=generator)
    scores = torch.randn(rows, vocab, generator=generator) * torch.rand(rows, 1, generator=generator) * 6
    for row, kind in enumerate(kinds.tolist()):
        if kind == 1:
            scores[row] = torch.randint(-3, 4, (vocab,), generator=generator).float()
        elif kind == 2:
            scores[row, : max(1, vocab // 3)] = scores[row].max() + 2.0  # a tied head above a cliff
        elif kind == 3:
            scores[row][torch.rand(vocab, generator=generator) < 0.5] = -math.inf
            scores[row, int(torch.randint(0, vocab, (1,), generator=generator))] = 1.0
        elif kind == 4:
            scores[row] = -math.inf
            scores[row, int(torch.randint(0, vocab, (1,), generator=generator))] = 0.5
        elif kind == 5:
            scores[row] = 3.0
    return scores


def exponents_for(generator: torch.Generator, rows: int) -> torch.Tensor:
    return torch.tensor(EXPONENTS)[torch.randint(0, len(EXPONENTS), (rows,), generator=generator)]


def test_ten_thousand_random_rows_keep_what_the_description_keeps():
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for batch in range(200):
        vocab = int(torch.randint(1, 80, (1,), generator=generator))
        scores = random_rows(generator, 50, vocab)
        if batch % 3 == 0:
            scores = scores.bfloat16()
        exponents = exponents_for(generator, 50)
        processed = MinKLogitsProcessor(exponents)(None, scores)
        assert processed.dtype == scores.dtype
        for row in range(50):
            expected = paper_keeps(scores[row].float(), float(exponents[row]))
            assert torch.isfinite(processed[row]).tolist() == expected, (batch, row, float(exponents[row]))
            checked += 1
        kept = torch.isfinite(processed)
        assert torch.equal(processed[kept], scores[kept])  # kept scores bit for bit
        assert (kept.any(dim=-1) | ~torch.isfinite(scores).any(dim=-1)).all()  # never an empty row
    assert checked == 10_000


def paper_keeps_array(row: np.ndarray, exponent: float) -> np.ndarray:
    """``paper_keeps`` with NumPy for long rows: the same float64 arithmetic, drop by drop in rank order, the first
    best rank taken (``argmax``)."""
    finite = row[row > -np.inf]
    if finite.size == 0:
        return np.zeros(row.shape, dtype=bool)
    ordered = np.sort(finite)[::-1]
    spread = ordered[0] - ordered[-1]
    if spread == 0:
        return row > -np.inf
    ranks = np.arange(1, ordered.size, dtype=np.float64)
    scores = (ordered[:-1] - ordered[1:]) / (spread * ranks**exponent)
    return row >= ordered[int(np.argmax(scores))]


def model_like_rows(generator: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Rows shaped like a language model's logits: a Zipf-like fall over the ranks, noise, a random order."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    slope = 0.6 + 1.2 * torch.rand(rows, 1, generator=generator)
    falling = -slope * ranks.log() + 0.3 * torch.randn(rows, vocab, generator=generator)
    order = torch.rand(rows, vocab, generator=generator).argsort(dim=-1)
    return falling.gather(1, order) * (1 + 3 * torch.rand(rows, 1, generator=generator))


def test_ten_thousand_rows_of_a_real_vocabulary_keep_what_the_description_keeps():
    """The CPU's certified passes (vocabularies of 4096 tokens and more) on 10,000 rows of 4096 to 12,000 tokens:
    spread, tied, plateaued, partly removed, one-token, constant and model-like rows, every exponent of the range's
    samples (0 and 0.5 included, where most rows fall through to the later passes and the sort), float32 and
    bfloat16, each row's kept set against the description computed row by row."""
    generator = torch.Generator().manual_seed(5)
    checked = certified_rows = 0
    for batch in range(40):
        vocab = int(torch.randint(CERTIFIED_FROM_VOCAB, 12_000, (1,), generator=generator))
        scores = torch.cat([random_rows(generator, 175, vocab), model_like_rows(generator, 75, vocab)])
        if batch % 3 == 0:
            scores = scores.bfloat16()
        exponents = exponents_for(generator, 250)
        processor = MinKLogitsProcessor(exponents)
        processed = processor(None, scores)
        logits = scores.float()
        weights = processor.weights(250, vocab, logits.device)
        certified_rows += int(certified_threshold(logits, weights, *STAGES[0])[1].sum())
        kept = torch.isfinite(processed).numpy()
        rows = logits.double().numpy()
        for row in range(250):
            expected = paper_keeps_array(rows[row], float(exponents[row]))
            assert np.array_equal(kept[row], expected), (batch, row, float(exponents[row]))
            checked += 1
        assert torch.equal(processed[torch.isfinite(processed)], scores[torch.isfinite(processed)])
    assert checked == 10_000 and certified_rows > 3000  # (most rows certified by the first pass)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_rows_take_the_certified_path_and_keep_what_the_description_keeps(dtype):
    generator = torch.Generator().manual_seed(1)
    vocab = CERTIFIED_FROM_VOCAB * 2
    scores = random_rows(generator, 48, vocab).to(dtype)
    exponents = exponents_for(generator, 48)
    processor = MinKLogitsProcessor(exponents)
    logits = scores.float()
    _, certified, _, _ = certified_threshold(logits, processor.weights(48, vocab, logits.device), *STAGES[0])
    assert certified.any() and not certified.all()  # both the certified rows and the later passes are exercised
    processed = processor(None, scores)
    for row in range(48):
        assert torch.isfinite(processed[row]).tolist() == paper_keeps(logits[row], float(exponents[row])), row


@pytest.mark.parametrize("bins", [16, 1024])
def test_the_histogram_bounds_every_deeper_cut_the_sort_scores(bins):
    """Oracle: every cut of the sorted row whose upper logit is at or below ``floor``, scored as the sort path
    scores it (float32 drop over the rank's weight): the histogram's bound is at least the best of them, on spread,
    tied, plateaued, partly removed and model-like rows, every sampled exponent, floors taken anywhere in the row."""
    generator = torch.Generator().manual_seed(8)
    vocab = 3000
    scores = torch.cat([random_rows(generator, 140, vocab), model_like_rows(generator, 60, vocab)])
    exponents = exponents_for(generator, 200)
    weights = MinKLogitsProcessor(exponents).weights(200, vocab, scores.device)
    finite = scores > -math.inf
    low = torch.where(finite, scores, math.inf).amin(dim=-1, keepdim=True)
    low = torch.where(low == math.inf, -math.inf, low)
    ordered = scores.sort(dim=-1, descending=True).values
    picks = torch.randint(0, vocab, (200, 1), generator=generator)
    floor = ordered.gather(1, picks)
    count = (scores > floor).sum(dim=-1, keepdim=True)
    bound = histogram_bound(scores, weights, low, floor, count, bins)
    drops = (ordered[:, :-1] - ordered[:, 1:]) / weights[:, : vocab - 1]
    deeper = (ordered[:, :-1] <= floor) & (ordered[:, 1:] > -math.inf)
    best = torch.where(deeper, drops, -math.inf).amax(dim=-1, keepdim=True)
    assert (best <= bound).all()
    usable = (low > -math.inf) & (ordered[:, :1] > low)
    assert torch.isfinite(bound[usable]).all() and (bound[~usable] == math.inf).all()


def test_rows_the_block_bound_cannot_certify_are_certified_by_their_histogram():
    """Exponent 0.5 on spread rows of 49152 tokens: the block maxima certify few rows (deep cuts weigh much), the
    histogram most of the rest, and every kept set is the description's."""
    generator = torch.Generator().manual_seed(4)
    scores = torch.randn(16, 49152, generator=generator) * 4
    processor = MinKLogitsProcessor(0.5)
    weights = processor.weights(16, 49152, scores.device)
    by_blocks = certified_threshold(scores, weights, *STAGES[0])[1]
    with_histogram = certified_threshold(scores, weights, *STAGES[1])[1]
    assert int(by_blocks.sum()) <= 4 and int(with_histogram.sum()) >= 12
    kept = torch.isfinite(processor(None, scores)).numpy()
    rows = scores.double().numpy()
    assert all(np.array_equal(kept[row], paper_keeps_array(rows[row], 0.5)) for row in range(16))


def test_rows_an_earlier_filter_cut_to_a_few_tokens_sort_those_alone(monkeypatch):
    """After a top-k (or any filter leaving at most FEW_LEFT tokens a row) on a real vocabulary, the finite logits are
    sorted alone (the certified passes are not run): every kept set is the description's, with ties, one token left,
    per-row exponents, float32 and bfloat16."""
    import decodekit.logits_processors.min_k as min_k

    monkeypatch.setattr(min_k, "certified_threshold", lambda *args: pytest.fail("the certified passes ran"))
    generator = torch.Generator().manual_seed(12)
    vocab = 2 * CERTIFIED_FROM_VOCAB
    scores = torch.cat([random_rows(generator, 40, vocab), model_like_rows(generator, 24, vocab)])
    best = scores.topk(50, dim=-1)  # (exactly 50 tokens a row: ties past the 50th removed too)
    scores = torch.full_like(scores, -math.inf).scatter_(1, best.indices, best.values)
    scores[:8] = torch.where(torch.rand(8, vocab, generator=generator) < 0.9, -math.inf, scores[:8])
    scores[8] = -math.inf
    scores[8, 17] = 2.0  # one token left
    for dtype in (torch.float32, torch.bfloat16):
        rows = scores.to(dtype)
        exponents = exponents_for(generator, 64)
        kept = torch.isfinite(MinKLogitsProcessor(exponents)(None, rows)).numpy()
        logits = rows.double().numpy()
        for row in range(64):
            assert np.array_equal(kept[row], paper_keeps_array(logits[row], float(exponents[row]))), (dtype, row)


@pytest.mark.parametrize("odd", ["nan", "tiny range", "huge range"])
def test_a_row_the_histogram_cannot_bin_does_not_stop_the_batch(odd):
    """A NaN logit, or a row whose range float32 bins cannot divide (1e-37 or 1e38 wide), at an exponent whose rows
    reach the histogram pass: the call returns, the odd row cut as the sort cuts it, the other rows as the
    description keeps."""
    from decodekit.logits_processors.min_k import cut_threshold

    generator = torch.Generator().manual_seed(13)
    scores = torch.randn(3, 2 * CERTIFIED_FROM_VOCAB, generator=generator) * 3
    if odd == "nan":
        scores[1, 5] = math.nan
    else:
        scores[1] *= 1e-37 if odd == "tiny range" else 1e38
    processor = MinKLogitsProcessor(0.5)
    kept = torch.isfinite(processor(None, scores))
    weights = processor.weights(3, scores.shape[1], scores.device)
    if odd != "nan":
        assert torch.equal(cut_threshold(scores, weights)[1], sorted_threshold(scores[1:2], weights)[0])
    for row in (0, 2):
        assert np.array_equal(kept[row].numpy(), paper_keeps_array(scores[row].double().numpy(), 0.5))


def test_a_long_flat_head_is_only_certified_by_the_full_sort_and_still_exact():
    """A plateau of 3000 equal logits above a cliff: every head drop is 0, so no block bound certifies the
    first pass or the second; the full sort keeps the whole plateau."""
    scores = torch.linspace(-5, -8, CERTIFIED_FROM_VOCAB * 2)[None].clone()
    scores[0, :3000] = 4.0
    processor = MinKLogitsProcessor(1.0)
    weights = processor.weights(1, scores.shape[1], scores.device)
    for stage in STAGES:
        assert not certified_threshold(scores, weights, *stage)[1].item()
    kept = torch.isfinite(processor(None, scores))[0]
    assert kept.tolist() == paper_keeps(scores[0], 1.0) and int(kept.sum()) == 3000


def test_the_cut_by_hand():
    """Sorted logits 5, 4.8, 4.5, 1, 0.8, 0: drops 0.2, 0.3, 3.5, 0.2, 0.8. By rank (exponent 1): 0.2, 0.15,
    1.17, 0.05, 0.16, so the cut is after the third token; by rank cubed 0.2 beats 3.5 / 27 = 0.13."""
    scores = torch.tensor([[0.0, 4.5, 5.0, 0.8, 4.8, 1.0]])

    def kept(exponent):
        return torch.isfinite(MinKLogitsProcessor(exponent)(None, scores))[0].tolist()

    assert kept(1.0) == [False, True, True, False, True, False]
    assert kept(3.0) == [False, False, True, False, False, False]
    assert kept(0.0) == [False, True, True, False, True, False]


@pytest.mark.parametrize("vocab", [300, CERTIFIED_FROM_VOCAB * 3])
def test_the_kept_set_is_the_same_at_every_temperature(vocab):
    """Dividing the logits by a power of two is exact and divides every drop alike; other temperatures round
    the logits, and the kept set still agrees on nearly every row."""
    generator = torch.Generator().manual_seed(2)
    scores = torch.randn(32, vocab, generator=generator) * 3
    processor = MinKLogitsProcessor(1.0)
    kept = torch.isfinite(processor(None, scores))
    for temperature in (0.25, 0.5, 2.0, 8.0):
        assert torch.equal(torch.isfinite(processor(None, scores / temperature)), kept)
    for temperature in (0.7, 1.5, 10.0):
        agree = (torch.isfinite(processor(None, scores / temperature)) == kept).all(dim=-1)
        assert agree.float().mean() >= 0.95


def test_rows_do_not_depend_on_each_other_and_per_request_values_apply():
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(4, CERTIFIED_FROM_VOCAB, generator=generator) * 3
    together = MinKLogitsProcessor([1.0, 2.0])(None, scores)  # one value per request of two rows each
    assert torch.equal(together[:2], MinKLogitsProcessor(1.0)(None, scores[:2]))
    assert torch.equal(together[2:], MinKLogitsProcessor(2.0)(None, scores[2:]))
    alone = torch.cat([MinKLogitsProcessor(0.5)(None, scores[row : row + 1]) for row in range(4)])
    assert torch.equal(MinKLogitsProcessor(0.5)(None, scores), alone)


def test_a_finite_filter_value_never_raises_a_score():
    """Drops 1, 8, 51 weighted by rank^-4: 1, 0.5, 0.63, so only the best token stays."""
    scores = torch.tensor([[10.0, 9.0, 1.0, -50.0]])
    processed = MinKLogitsProcessor(4.0, filter_value=-20.0)(None, scores)
    assert processed.tolist() == [[10.0, -20.0, -20.0, -50.0]]


@pytest.mark.parametrize("bad", [-0.1, 4.5, math.nan, math.inf])
def test_bad_exponents_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"min_k must be (a number )?in \[0, 4\]"):
        MinKLogitsProcessor(bad)
    with pytest.raises(ValueError, match=r"min_k must be (a number )?in \[0, 4\]"):
        Strategy(min_k=bad)


def test_bad_scores_are_refused():
    with pytest.raises(ValueError, match="MinKLogitsProcessor: scores must be a \\[batch, vocab\\] tensor"):
        MinKLogitsProcessor()(None, torch.zeros(3))


def test_the_strategy_field_builds_the_processor_and_samples(tiny):
    model, tokenizer = tiny
    strategy = Strategy(temperature=1.5, min_k=1.0)
    plan = strategy.plan(model, tokenizer=tokenizer)
    (processor,) = [p for p in plan.processors if isinstance(p, MinKLogitsProcessor)]
    assert processor.exponent.scalar == 1.0
    assert plan.sampling == {"do_sample": True, "temperature": 1.5, "top_k": 0, "top_p": 1.0}
    assert strategy.label == "sample(temperature=1.5, min_k=1.0)"
