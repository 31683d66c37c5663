"""Epsilon sampling: keep the tokens at least ``epsilon`` likely."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from decodekit.logits_processors._entropy import TemperatureFilter, at_temperature, filtered
from decodekit.logits_processors._rows import RowParameter, RowValues, check_scores


class EpsilonLogitsProcessor(TemperatureFilter):
    r"""Epsilon sampling (Hewitt et al., 2022, "Truncation Sampling as Language Model Desmoothing").

    A token is kept when its probability, at the temperature it will be sampled at, is at least
    ``epsilon``; the most likely token is always kept. With one ``epsilon`` and ``temperature=1``
    it keeps what transformers' ``EpsilonLogitsWarper`` keeps; here ``epsilon`` and the
    temperature may differ per row, and the filter runs before generate's temperature (which is
    why it takes the temperature).

    Args:
        epsilon: the least probability kept, in (0, 1); one value or one per batch row (or request).
        temperature: the temperature the probabilities are judged at, in [1e-6, 1e4]; one or per row.
        filter_value: the score given to removed tokens (default -inf).

    Example:
        >>> import torch
        >>> scores = torch.log(torch.tensor([[0.6, 0.3, 0.07, 0.03]]))
        >>> EpsilonLogitsProcessor(0.05)(None, scores).isfinite().tolist()
        [[True, True, True, False]]
    """

    def __init__(self, epsilon: RowValues, temperature: RowValues = 1.0, filter_value: float = -math.inf) -> None:
        super().__init__(
            RowParameter("epsilon_cutoff", epsilon, low=0.0, high=1.0, low_open=True, high_open=True),
            temperature,
            filter_value,
        )
        self.epsilon = self.parameter

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, _ = check_scores(scores, "EpsilonLogitsProcessor")
        probabilities = at_temperature(scores, self.temperature).softmax(dim=-1)
        epsilon = self.epsilon.for_rows(rows, scores.device, torch.float32)
        keep = (probabilities >= epsilon) | (scores >= scores.amax(dim=-1, keepdim=True))
        return filtered(scores, keep, self.filter_value)


def from_strategy(values: Mapping[str, Any], context: Any) -> EpsilonLogitsProcessor:
    """The processor for a Strategy's ``epsilon_cutoff``, judged at its temperature."""
    return EpsilonLogitsProcessor(values["epsilon_cutoff"], temperature=context.temperature)
