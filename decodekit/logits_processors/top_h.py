"""Top-H: keep the likeliest tokens while their share of the entropy stays within a bound."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from decodekit.logits_processors._entropy import TemperatureFilter, filtered
from decodekit.logits_processors._rows import RowParameter, RowValues, check_scores

TOP_H_CANDIDATES = 100  # the likeliest tokens the bound is computed over, as transformers' TopHLogitsWarper


class TopHLogitsProcessor(TemperatureFilter):
    r"""Top-H sampling (Potraghloo et al., NeurIPS 2025, "Top-H Decoding", arXiv 2509.02510), as
    transformers 5.23's ``TopHLogitsWarper`` computes it, with per-row parameters.

    Over the ``TOP_H_CANDIDATES`` (100) likeliest tokens at the sampling temperature, renormalized to
    ``p``, tokens are kept in order of probability while their cumulative entropy terms
    ``sum -p_i log p_i`` stay within ``top_h * H(p)``; the likeliest is always kept. A smaller
    ``top_h`` keeps fewer tokens (more coherent), a larger one more (more diverse). A token an
    earlier filter removed counts as probability 0 (transformers' warper turns such a row's terms into
    NaN and keeps only its best token).

    Args:
        top_h: the share of the entropy kept, in (0, 1]; one value or one per batch row (or request).
        temperature: the temperature the distribution is judged at, in [1e-6, 1e4]; one or per row.
        filter_value: the score given to removed tokens (default -inf).

    Example:
        >>> import torch
        >>> scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))  # terms 0.35, 0.36, 0.28, 0.15; H = 1.14
        >>> TopHLogitsProcessor(0.7)(None, scores).isfinite().tolist()
        [[True, True, False, False]]
    """

    def __init__(self, top_h: RowValues, temperature: RowValues = 1.0, filter_value: float = -math.inf) -> None:
        super().__init__(RowParameter("top_h", top_h, low=0.0, high=1.0, low_open=True), temperature, filter_value)
        self.top_h = self.parameter

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, vocab = check_scores(scores, "TopHLogitsProcessor")
        top, index = scores.float().topk(min(TOP_H_CANDIDATES, vocab), dim=-1)
        if not (self.temperature.is_scalar and self.temperature.scalar == 1.0):
            top = top / self.temperature.for_rows(rows, scores.device, torch.float32)
        log_probs = top.log_softmax(dim=-1)
        terms = -(log_probs.exp() * log_probs.clamp(min=torch.finfo(torch.float32).min))
        bound = terms.sum(dim=-1, keepdim=True) * self.top_h.for_rows(rows, scores.device, torch.float32)
        # A relative slack of 1e-6 so that top_h=1 keeps every candidate whatever the summation order's rounding.
        chosen = terms.cumsum(dim=-1) <= bound * (1 + 1e-6)
        chosen[:, 0] = True
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, index, chosen)
        return filtered(scores, keep, self.filter_value)


def from_strategy(values: Mapping[str, Any], context: Any) -> TopHLogitsProcessor:
    """The processor for a Strategy's ``top_h``, judged at its temperature."""
    return TopHLogitsProcessor(values["top_h"], temperature=context.temperature)
