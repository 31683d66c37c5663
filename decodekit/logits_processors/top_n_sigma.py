"""Top-nσ: keep the tokens whose logit lies within n standard deviations of the row's best."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from transformers import LogitsProcessor

from decodekit.logits_processors._rows import RowParameter, RowValues, check_filter_value, check_scores, keep_bound
from decodekit.settings import TOP_N_SIGMA_RANGE


class TopNSigmaLogitsProcessor(LogitsProcessor):
    r"""Top-nσ sampling (Tang et al., 2024, "Top-nσ: Not All Logits Are You Need").

    A token is kept when its logit is at least ``max - n * std``, the standard deviation (with
    Bessel's correction, as ``torch.std``) taken over the row's finite logits (tokens an earlier
    filter removed do not count).
    Dividing logits by a temperature divides the maximum and the deviation alike, so the kept set
    is the same at every sampling temperature: the filter is judged at the temperature you sample
    at, whatever it is. The best token is always kept; ``n = 0`` keeps only it (and its ties).

    Args:
        n: how many standard deviations below the maximum a kept logit may lie; >= 0, one value
            or one per batch row (or per request).
        filter_value: the score given to removed tokens (default -inf).

    Example:
        >>> import torch
        >>> scores = torch.tensor([[4.0, 3.5, 0.0, -1.0]])  # max 4, std 2.5: n=1 keeps logits >= 1.5
        >>> TopNSigmaLogitsProcessor(1.0)(None, scores).isfinite().tolist()
        [[True, True, False, False]]
    """

    supports_continuous_batching = False

    def __init__(self, n: RowValues, filter_value: float = -math.inf) -> None:
        self.n = RowParameter("top_n_sigma", n, low=TOP_N_SIGMA_RANGE[0], high=TOP_N_SIGMA_RANGE[1])
        self.filter_value = check_filter_value(filter_value)
        self.supports_continuous_batching = self.n.is_scalar

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, _ = check_scores(scores, "TopNSigmaLogitsProcessor")
        logits = scores.float()
        vocab = logits.shape[-1]
        # Float arithmetic instead of boolean masks, which cost more on CPU: an infinite logit times
        # 0 is NaN, so NaN marks the entries left out of the statistics.
        count = vocab - torch.nan_to_num(logits * 0.0, nan=1.0).sum(dim=-1, keepdim=True)
        zeroed = torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=0.0)
        # The variance from the sum and the sum of squares (float32 sums of logits, whose squares
        # stay far from cancelling: the relative error on the deviation is below 1e-5).
        total = zeroed.sum(dim=-1, keepdim=True)
        squares = torch.linalg.vector_norm(zeroed, dim=-1, keepdim=True).square()
        variance = ((squares - total.square() / count.clamp(min=1)) / (count - 1).clamp(min=1)).clamp(min=0)
        top = logits.amax(dim=-1, keepdim=True)
        threshold = top - self.n.for_rows(rows, scores.device, torch.float32) * variance.sqrt()
        threshold = torch.minimum(threshold, top)  # the best token survives any rounding
        bound = keep_bound(logits, threshold)  # +inf to keep, -inf to remove
        if self.filter_value != -math.inf:
            bound.clamp_(min=self.filter_value)
        return torch.minimum(scores.float(), bound, out=bound).to(scores.dtype)


def from_strategy(values: Mapping[str, Any], context: Any) -> TopNSigmaLogitsProcessor:
    """The processor for a Strategy's ``top_n_sigma``."""
    return TopNSigmaLogitsProcessor(values["top_n_sigma"])
