"""Locally typical sampling: keep the tokens whose surprise is closest to the distribution's entropy."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from decodekit.logits_processors._entropy import TemperatureFilter, at_temperature, filtered
from decodekit.logits_processors._rows import RowParameter, RowValues, check_scores


class TypicalLogitsProcessor(TemperatureFilter):
    r"""Locally typical sampling (Meister et al., 2023, "Locally Typical Sampling").

    Tokens are ranked by how far their surprise ``-log p`` lies from the entropy ``H`` of the
    distribution at the temperature it will be sampled at, closest first, and kept in that order
    until their probabilities reach ``typical_p``; the most typical token is always kept. With one
    ``typical_p`` and ``temperature=1`` it keeps what transformers' ``TypicalLogitsWarper`` keeps;
    here both may differ per row.

    Args:
        typical_p: the probability mass kept, in (0, 1]; one value or one per batch row (or request).
        temperature: the temperature the distribution is judged at, in [1e-6, 1e4]; one or per row.
        filter_value: the score given to removed tokens (default -inf).

    Example:
        >>> import torch
        >>> scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))  # H = 1.14: surprises 0.69, 1.2, 1.9, 3.0
        >>> TypicalLogitsProcessor(0.7)(None, scores).isfinite().tolist()
        [[True, True, False, False]]
    """

    def __init__(self, typical_p: RowValues, temperature: RowValues = 1.0, filter_value: float = -math.inf) -> None:
        super().__init__(
            RowParameter("typical_p", typical_p, low=0.0, high=1.0, low_open=True), temperature, filter_value
        )
        self.typical_p = self.parameter

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, vocab = check_scores(scores, "TypicalLogitsProcessor")
        logits = at_temperature(scores, self.temperature)
        log_probs = logits.log_softmax(dim=-1)
        typical = -(log_probs * log_probs.exp()).nansum(dim=-1, keepdim=True)  # the entropy; removed tokens add 0
        distance = (-log_probs - typical).abs()  # removed tokens: +inf, ranked last
        ranked, order = distance.sort(dim=-1, stable=True)
        mass = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
        target = self.typical_p.for_rows(rows, scores.device, torch.float32)
        last = (mass < target).sum(dim=-1, keepdim=True).clamp_(max=vocab - 1)
        # Keep every token no farther than the last one needed to reach the mass (ties stay together).
        keep = distance <= ranked.gather(-1, last)
        keep.scatter_(-1, order[:, :1], True)
        return filtered(scores, keep, self.filter_value)


def from_strategy(values: Mapping[str, Any], context: Any) -> TypicalLogitsProcessor:
    """The processor for a Strategy's ``typical_p``, judged at its temperature."""
    return TypicalLogitsProcessor(values["typical_p"], temperature=context.temperature)
