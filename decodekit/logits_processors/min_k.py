"""Min-k: keep the tokens above the largest rank-weighted drop of the sorted logits (a temperature-invariant cut)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from transformers import LogitsProcessor

from decodekit.logits_processors._rows import RowParameter, RowValues, check_filter_value, check_scores, keep_bound
from decodekit.settings import MIN_K_EXPONENT_RANGE

# Below this vocabulary a full sort costs little on a CPU, and the rows take the sorted path everywhere.
CERTIFIED_FROM_VOCAB = 4096
# The CPU's certified passes, tried in turn on the rows the previous one could not certify (block size, block
# maxima per group of the bound, blocks gathered, head tokens kept, histogram bins: 0 for none); the rows left after
# all of them are sorted.
STAGES = ((128, 4, 4, 16, 0), (32, 1, 32, 256, 1024))
# At most this many finite logits in every row (an earlier filter removed the others): those are sorted alone.
FEW_LEFT = 1024
# Rows binned at once by histogram_bound.
HISTOGRAM_ROWS = 8
# The relative error a bin's edges allow for: the rounding of a logit's bin (a subtraction and a product in float32).
EDGE_SLACK = 1e-6


class MinKLogitsProcessor(LogitsProcessor):
    r"""Min-k sampling (Ding, Li, Garces Arias, Aßenmacher, Heumann and Zhang, ACL 2026, "Min-k Sampling:
    Decoupling Truncation from Temperature Scaling via Relative Logit Dynamics", arXiv 2604.11012), as far
    as its definition could be verified.

    The paper's method section could not be read where this was written (only its abstract); the
    definition below is the one described in vLLM pull request #48142, which adds Min-k to vLLM: sort a
    row's logits, normalize the drop between adjacent sorted logits by the logit range, weight each drop
    by one over its rank, and truncate at the cut that description names (its text breaks off there; the
    abstract calls the cut the "semantic cliff", read here as the largest weighted drop). With
    ``l_(1) >= l_(2) >= ...`` the row's finite logits sorted, the drop at rank ``i`` scores
    ``(l_(i) - l_(i+1)) / (range * i^exponent)``; the first rank ``i*`` of the highest score is the cut,
    and the tokens with ``l >= l_(i*)`` are kept. The range divides every score alike, so it does not move
    the cut, and neither does a temperature: dividing the logits by ``T`` divides every drop by ``T``.
    Hence the kept set is the same at every sampling temperature, as the paper proves for its method.
    ``exponent`` generalizes the published ``1 / rank`` weighting (``exponent=1``, the default): 0 cuts
    at the largest raw drop anywhere, larger values at earlier ranks (fewer tokens). The paper's own
    hyperparameter (``min_k_tau``, 3 by default in the llama.cpp build that implements it, according to
    the omp-samplers extension's catalog) is not implemented: its role could not be verified.

    Ties are never split (a drop between equal logits scores 0), tokens an earlier filter removed (-inf)
    take no part, and the best token is always kept.

    On a CPU the full sort (about 50 to 70 times min-p's cost on ``[32, 49152]`` scores) is avoided: each
    row's cut is found among its head, the tokens of the blocks holding the highest logits, and certified
    exactly by a bound on every deeper cut computed from block maxima; rows whose bound does not clear the
    head's best cut (mostly exponents below 1, whose deep cuts weigh more) are bounded again by a histogram
    of their logits (each bin's count gives the least rank of a cut in it), then with a larger head, then
    sorted; rows an earlier filter left with at most ``FEW_LEFT`` tokens sort those alone. The result equals the
    sort's on every row. Other devices sort every row (no value is read back).

    Args:
        exponent: the rank weighting ``i^-exponent``, in [0, 4]; 1 is the published weighting. One value or
            one per batch row (or per request).
        filter_value: the score given to removed tokens (default -inf).

    Example:
        >>> import torch
        >>> scores = torch.tensor([[5.0, 4.8, 4.5, 1.0, 0.8, 0.0]])  # drops 0.2, 0.3, 3.5, 0.2, 0.8
        >>> MinKLogitsProcessor()(None, scores).isfinite().tolist()  # 3.5 / 3 is the largest weighted drop
        [[True, True, True, False, False, False]]
        >>> MinKLogitsProcessor(3.0)(None, scores).isfinite().tolist()  # 0.2 / 1 > 3.5 / 27
        [[True, False, False, False, False, False]]
    """

    supports_continuous_batching = False

    def __init__(self, exponent: RowValues = 1.0, filter_value: float = -math.inf) -> None:
        low, high = MIN_K_EXPONENT_RANGE
        self.exponent = RowParameter("min_k", exponent, low=low, high=high)
        self.filter_value = check_filter_value(filter_value)
        self.supports_continuous_batching = self.exponent.is_scalar
        self._weights: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    def weights(self, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        """``rank^exponent`` for ranks 1..vocab, ``[1 or rows, vocab]`` float32, built once per shape (in
        float64, then rounded once, so that every path divides by the same values)."""
        key = (rows if not self.exponent.is_scalar else 1, vocab, device)
        if key not in self._weights:
            exponent = self.exponent.values if self.exponent.is_scalar else self.exponent.for_rows(
                rows, torch.device("cpu"), torch.float64
            )  # fmt: skip
            ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
            self._weights[key] = ranks.pow(exponent.reshape(-1, 1)).float().to(device)
        return self._weights[key]

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, vocab = check_scores(scores, "MinKLogitsProcessor")
        logits = scores.float()
        weights = self.weights(rows, vocab, scores.device)
        if logits.device.type != "cpu" or vocab < CERTIFIED_FROM_VOCAB:
            return _filter(scores, logits, sorted_threshold(logits, weights), self.filter_value)
        if bool(logits.amin() == -math.inf):  # an earlier filter removed tokens: few may be left
            finite = int(torch.count_nonzero(logits > -math.inf, dim=-1).max())
            if finite <= FEW_LEFT:  # (the cut needs only the finite logits, in order: sorted where they are few)
                top, where = logits.topk(max(finite, 1), dim=-1)
                threshold = sorted_threshold(top, weights[:, : top.shape[1]])
                if self.filter_value != -math.inf:
                    return _filter(scores, logits, threshold, self.filter_value)
                return _head_kept(scores, top, where, threshold)
        threshold, pending, head, index = _certified_thresholds(logits, weights)
        if self.filter_value != -math.inf or len(pending) == rows:
            return _filter(scores, logits, threshold, self.filter_value)
        out = _head_kept(scores, head, index, threshold)  # (a certified row keeps head tokens only)
        if len(pending):
            out[pending] = _filter(scores[pending], logits[pending], threshold[pending], self.filter_value)
        return out


def _head_kept(scores: torch.Tensor, head: torch.Tensor, index: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Rows of -inf in ``scores``' shape and dtype holding the ``head`` logits at or above ``threshold`` at their
    ``index`` (indices past the row are padding): what filtering keeps where every kept token is in the head,
    without comparing every logit."""
    rows, vocab = scores.shape
    kept = torch.where(head >= threshold, head, -math.inf).to(scores.dtype)
    out = torch.full((rows, max(vocab, int(index.max()) + 1)), -math.inf, dtype=scores.dtype, device=scores.device)
    return out.scatter_(1, index, kept)[:, :vocab]


def _filter(scores: torch.Tensor, logits: torch.Tensor, threshold: torch.Tensor, filter_value: float) -> torch.Tensor:
    """``scores`` with the logits below ``threshold`` lowered to ``filter_value`` (never raised)."""
    bound = keep_bound(logits, threshold)  # +inf to keep, -inf to remove
    if filter_value != -math.inf:
        bound.clamp_(min=filter_value)
    return torch.minimum(logits, bound, out=bound).to(scores.dtype)


def cut_threshold(logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each row's lowest kept logit, ``[rows, 1]``: certified passes on a CPU, the full sort elsewhere.

    Example:
        >>> cut_threshold(torch.tensor([[3.0, 2.5, 0.0, -0.5]]), torch.arange(1.0, 5.0)[None]).tolist()  # 2.5 / 2
        [[2.5]]
    """
    if logits.device.type != "cpu" or logits.shape[1] < CERTIFIED_FROM_VOCAB:
        return sorted_threshold(logits, weights)
    return _certified_thresholds(logits, weights)[0]


def _certified_thresholds(
    logits: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """On a CPU: each row's threshold, the rows the first pass could not certify (their thresholds from the later
    passes or the sort), and the first pass's head and its indices."""
    rows = logits.shape[0]
    threshold, certified, head, index = certified_threshold(logits, weights, *STAGES[0])
    pending = torch.arange(rows)[~certified.flatten()]  # on a CPU, reading the certificate waits for nothing
    if len(pending) == rows:
        threshold = _uncertified_threshold(logits, weights)
    elif len(pending):
        threshold[pending] = _uncertified_threshold(logits[pending], _rows_of(weights, pending))
    return threshold, pending, head, index


def _uncertified_threshold(logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The later passes on rows the first could not certify, then the full sort on those left."""
    rows = logits.shape[0]
    threshold = torch.empty(rows, 1)
    pending = torch.arange(rows)
    for stage in STAGES[1:]:
        every = len(pending) == rows  # (every row: no copy of them)
        found, certified, _, _ = certified_threshold(logits if every else logits[pending],
                                                     weights if every else _rows_of(weights, pending), *stage)
        threshold[pending] = found
        pending = pending[~certified.flatten()]
        if not len(pending):
            return threshold
    threshold[pending] = sorted_threshold(logits[pending], _rows_of(weights, pending))
    return threshold


def _rows_of(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return weights if weights.shape[0] == 1 else weights[rows]


def sorted_threshold(logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The cut by the definition: sort each row, score every drop between finite neighbours, take the first
    best rank's logit. A row with one finite logit (or none) keeps its best.

    Example:
        >>> sorted_threshold(torch.tensor([[0.0, 2.0, 1.5, float("-inf")]]), torch.ones(1, 4)).tolist()
        [[1.5]]
    """
    ordered = logits.sort(dim=-1, descending=True).values
    if ordered.shape[1] == 1:
        return ordered
    drops = (ordered[:, :-1] - ordered[:, 1:]) / weights[:, : ordered.shape[1] - 1]
    scored = torch.where(ordered[:, 1:] > -math.inf, drops, -math.inf)
    return ordered.gather(1, scored.argmax(dim=-1, keepdim=True))


def certified_threshold(
    logits: torch.Tensor, weights: torch.Tensor, block: int, group: int, pool_blocks: int, pool_top: int,
    bins: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best cut among each row's head, whether it is provably the row's best cut, and the head (its
    logits and their indices in the row; indices past the row are padding).

    The row is read in blocks of ``block`` logits. The ``pool_top`` highest logits of the ``pool_blocks``
    blocks with the highest maxima hold, in order, every logit above ``floor`` (the lower of the last chosen
    block's maximum and the last head logit, itself a logit of the row), so the drops between them and the
    drop from the last to ``floor`` are the row's own, at their own ranks. A cut below ``floor`` keeps at
    least ``count + 1`` tokens; between two consecutive sorted maxima ``m_j > m_(j+1)`` of groups of
    ``group`` blocks it keeps at least ``j`` tokens and drops by at most ``min(m_j, floor) - m_(j+1)`` (the
    next logit below is at least ``m_(j+1)``), and below the last group maximum it drops to the row's
    lowest finite logit at most, keeping at least as many tokens as blocks reach that maximum. With ``bins``,
    a second bound (``histogram_bound``) replaces it where lower. The head's best cut is certified when it
    scores strictly above the bound (rounding only lowers the bounded scores: subtraction and division round
    monotonically).

    Example:
        >>> logits = torch.cat([torch.tensor([10.0]), torch.linspace(0, -1, 4095)])[None]  # one clear cliff
        >>> threshold, certified, head, index = certified_threshold(logits, torch.ones(1, 4096), 128, 4, 4, 16)
        >>> threshold.item(), certified.item(), index[0, :2].tolist()
        (10.0, True, [0, 1])
    """
    rows, vocab = logits.shape
    row_logits = logits
    low = logits.amin(dim=-1, keepdim=True)
    if not torch.isfinite(low).all():  # a removed token: the lowest finite logit instead (none: -inf)
        low = torch.where(logits > -math.inf, logits, math.inf).amin(dim=-1, keepdim=True)
        low = torch.where(low == math.inf, -math.inf, low)
    span = block * group
    if vocab % span:  # copies of the lowest logit change no drop and no rank above it
        logits = torch.cat([logits, low.expand(rows, span - vocab % span)], dim=1)
    blocks = logits.view(rows, -1, block)
    block_max = blocks.amax(dim=-1)
    top_blocks, chosen = block_max.topk(pool_blocks, dim=-1)
    pool = blocks.gather(1, chosen[:, :, None].expand(-1, -1, block)).view(rows, pool_blocks * block)
    head, position = pool.topk(pool_top, dim=-1)
    floor = torch.maximum(top_blocks[:, -1:], head[:, -1:])
    above = head > floor
    count = above.sum(dim=-1, keepdim=True)
    below = torch.cat([torch.where(above[:, 1:], head[:, 1:], floor), floor], dim=1)
    scored = torch.where(above & (below > -math.inf), (head - below) / weights[:, :pool_top], -math.inf)
    cut = scored.argmax(dim=-1, keepdim=True)
    best = scored.gather(1, cut)

    maxima = block_max if group == 1 else block_max.view(rows, -1, group).amax(dim=-1)
    ceilings = maxima.sort(dim=-1, descending=True).values.clamp(min=low)
    floors = torch.cat([ceilings[:, 1:], low], dim=1)
    ranks = torch.maximum(torch.arange(1, ceilings.shape[1] + 1, device=logits.device), count + 1)
    reaching = (block_max >= ceilings[:, -1:]).sum(dim=-1, keepdim=True)
    ranks = torch.cat([ranks[:, :-1], torch.maximum(ranks[:, -1:], reaching)], dim=1)
    drops = (torch.minimum(ceilings, floor) - floors).clamp(min=0)
    bound = (drops / weights.expand(rows, -1).gather(1, ranks - 1)).amax(dim=-1, keepdim=True)
    if bins:
        bound = torch.minimum(bound, histogram_bound(row_logits, weights, low, floor, count, bins))
    index = chosen.gather(1, position // block) * block + position % block
    return head.gather(1, cut), best > bound, head, index


def histogram_bound(
    logits: torch.Tensor, weights: torch.Tensor, low: torch.Tensor, floor: torch.Tensor, count: torch.Tensor,
    bins: int,
) -> torch.Tensor:
    """``[rows, 1]``: a bound on the score of every cut at or below ``floor`` (each row's head holds its ``count``
    logits above it), from a histogram of the row's finite logits in ``bins`` equal bins from ``low`` (its lowest)
    to its highest.

    A cut's upper logit in bin ``b`` ranks below every logit of the bins above (bins follow the logits' order,
    their rounding included) and below the head's ``count``; the next logit down lies in ``b`` or in the nearest
    bin below that holds one, so the drop is at most from ``b``'s upper edge (or ``floor``) to that bin's lower
    edge. Edges widened by ``EDGE_SLACK`` of the row's range hold every logit a bin's rounding put in it; the
    bound is computed in float64 and widened alike, above every score the float32 sort path can compute for such
    a cut.

    Example:
        >>> logits = torch.tensor([[9.0, 5.0, 4.9, 4.8, 0.0]])
        >>> bound = histogram_bound(logits, torch.ones(1, 5), torch.tensor([[0.0]]), torch.tensor([[5.0]]),
        ...                         torch.tensor([[1]]), 90)
        >>> 4.8 - 0.1 < bound.item() < 4.8 + 0.2  # (the drop from 4.8 to 0, within a bin's width)
        True
    """
    rows, vocab = logits.shape
    high = logits.amax(dim=-1, keepdim=True)
    usable = torch.isfinite(low) & torch.isfinite(high) & (high > low)
    scale = torch.where(usable, bins / torch.where(usable, high - low, 1.0), 0.0)
    usable &= torch.isfinite(scale) & (scale > 0)  # (a range too narrow or too wide for float32 bins: not bounded)
    scale = torch.where(usable, scale, 0.0)
    removed = bool(logits.amin() == -math.inf)
    counts = torch.empty(rows, bins + 1, dtype=torch.int64, device=logits.device)
    for first in range(0, rows, HISTOGRAM_ROWS):  # (a few rows at a time: no row-sized temporaries to allocate)
        part = slice(first, first + HISTOGRAM_ROWS)
        chunk = logits[part]
        index = (chunk - low[part]).mul_(scale[part]).clamp_(0, bins - 1).to(torch.int32)  # (truncation: floor)
        index.clamp_(0, bins - 1)  # (a NaN, in a row not bounded, casts to no bin)
        if removed:  # removed tokens: a bin of their own, past the others
            index.masked_fill_(chunk == -math.inf, bins)
        index += torch.arange(chunk.shape[0], dtype=torch.int32, device=logits.device)[:, None] * (bins + 1)
        counts[part] = torch.bincount(index.view(-1), minlength=index.numel() // vocab * (bins + 1)).view(-1, bins + 1)
    counts = counts[:, :bins]
    width = torch.where(usable, 1.0 / scale.double(), 0.0)
    low64, high64 = low.double(), high.double()
    edges = low64 + torch.arange(bins + 1, device=logits.device, dtype=torch.float64) * width
    slack = EDGE_SLACK * torch.where(usable, high64 - low64, 0.0)  # (the rounding is relative to logit - low)
    lower_edge = (edges[:, :-1] - slack).clamp(min=low64)
    upper_edge = (edges[:, 1:] + slack).clamp(max=high64)
    upper_edge[:, -1:] = high64
    held = counts > 0
    marked = torch.where(held, torch.arange(bins, device=logits.device), -1)
    below = torch.cat([torch.full((rows, 1), -1, device=logits.device), marked[:, :-1].cummax(dim=-1).values], dim=1)
    next_lower = torch.where(below >= 0, lower_edge.gather(1, below.clamp(min=0)), lower_edge)
    drops = (torch.minimum(upper_edge, floor.double()) - next_lower).clamp(min=0)
    above = counts.flip(-1).cumsum(-1).flip(-1) - counts  # logits in the bins above
    ranks = torch.maximum(above + 1, count + 1).clamp(max=vocab)
    scored = drops * (1 + EDGE_SLACK) / weights.expand(rows, -1).gather(1, ranks - 1).double()
    scored = torch.where(held & (lower_edge <= floor.double()), scored, -math.inf)
    bound = scored.amax(dim=-1, keepdim=True).float().nextafter(torch.tensor(math.inf))
    return torch.where(usable, bound, math.inf)


def from_strategy(values: Mapping[str, Any], context: Any) -> MinKLogitsProcessor:
    """The processor for a Strategy's ``min_k`` (the rank-weight exponent); the cut needs no temperature."""
    return MinKLogitsProcessor(values["min_k"])
