"""Eta sampling: keep the tokens more likely than a cutoff that falls as the distribution's entropy grows."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from decodekit.logits_processors._entropy import TemperatureFilter, at_temperature, entropy, filtered
from decodekit.logits_processors._rows import RowParameter, RowValues, check_scores


class EtaLogitsProcessor(TemperatureFilter):
    r"""Eta sampling (Hewitt et al., 2022, "Truncation Sampling as Language Model Desmoothing").

    A token is kept when its probability is at least ``eta = min(epsilon, sqrt(epsilon) * exp(-H))``,
    ``H`` the entropy (in nats) of the distribution at the temperature it will be sampled at: a
    flat distribution keeps more of its tail than a peaked one. The most likely token is always
    kept. With one ``epsilon`` and ``temperature=1`` it keeps what transformers'
    ``EtaLogitsWarper`` keeps; here both may differ per row.

    Args:
        epsilon: the cutoff's ceiling, in (0, 1); one value or one per batch row (or request).
        temperature: the temperature the distribution is judged at, in [1e-6, 1e4]; one or per row.
        filter_value: the score given to removed tokens (default -inf).

    Example:
        >>> import torch
        >>> scores = torch.log(torch.tensor([[0.6, 0.3, 0.07, 0.03]]))  # H = 0.97: eta = min(0.05, 0.084)
        >>> EtaLogitsProcessor(0.05)(None, scores).isfinite().tolist()
        [[True, True, True, False]]
    """

    def __init__(self, epsilon: RowValues, temperature: RowValues = 1.0, filter_value: float = -math.inf) -> None:
        super().__init__(
            RowParameter("eta_cutoff", epsilon, low=0.0, high=1.0, low_open=True, high_open=True),
            temperature,
            filter_value,
        )
        self.epsilon = self.parameter

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, _ = check_scores(scores, "EtaLogitsProcessor")
        logits = at_temperature(scores, self.temperature)
        epsilon = self.epsilon.for_rows(rows, scores.device, torch.float32)
        eta = torch.minimum(epsilon, epsilon.sqrt() * torch.exp(-entropy(logits)))
        keep = (logits.softmax(dim=-1) >= eta) | (scores >= scores.amax(dim=-1, keepdim=True))
        return filtered(scores, keep, self.filter_value)


def from_strategy(values: Mapping[str, Any], context: Any) -> EtaLogitsProcessor:
    """The processor for a Strategy's ``eta_cutoff``, judged at its temperature."""
    return EtaLogitsProcessor(values["eta_cutoff"], temperature=context.temperature)
