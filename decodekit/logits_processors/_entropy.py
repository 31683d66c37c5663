"""Shared pieces of the entropy- and probability-based filters, computed as transformers' warpers compute
them (so that the same tokens are kept, rounding included)."""

from __future__ import annotations

import math

import torch
from transformers import LogitsProcessor

from decodekit.logits_processors._rows import TEMPERATURE_RANGE, RowParameter, RowValues, check_filter_value


class TemperatureFilter(LogitsProcessor):
    """A filter with one parameter (one value, or one per row or request), judged on the distribution at
    the temperature the tokens will be sampled at; removed tokens get ``filter_value``."""

    supports_continuous_batching = False

    def __init__(self, parameter: RowParameter, temperature: RowValues = 1.0, filter_value: float = -math.inf) -> None:
        self.parameter = parameter
        self.temperature = RowParameter("temperature", temperature, low=TEMPERATURE_RANGE[0], high=TEMPERATURE_RANGE[1])
        self.filter_value = check_filter_value(filter_value)
        self.supports_continuous_batching = parameter.is_scalar and self.temperature.is_scalar


def at_temperature(scores: torch.Tensor, temperature: RowParameter) -> torch.Tensor:
    """``scores`` as float32 logits divided by each row's temperature.

    Example:
        >>> from decodekit.logits_processors._rows import RowParameter
        >>> at_temperature(torch.tensor([[1.0, 2.0]]), RowParameter("temperature", 0.5, low=1e-6, high=1e4))
        tensor([[2., 4.]])
    """
    logits = scores.float()
    if temperature.is_scalar and temperature.scalar == 1.0:
        return logits
    return logits / temperature.for_rows(scores.shape[0], scores.device, torch.float32)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's entropy in nats, ``[rows, 1]``, as ``torch.distributions.Categorical`` computes it;
    removed tokens (-inf) add nothing.

    Example:
        >>> round(entropy(torch.tensor([[0.0, 0.0, float("-inf")]])).item(), 4)  # ln 2
        0.6931
    """
    normalized = logits - logits.logsumexp(dim=-1, keepdim=True)
    probabilities = normalized.softmax(dim=-1)
    return -(normalized.clamp(min=torch.finfo(logits.dtype).min) * probabilities).sum(dim=-1, keepdim=True)


def filtered(scores: torch.Tensor, keep: torch.Tensor, filter_value: float) -> torch.Tensor:
    """``scores`` with the tokens not in ``keep`` set to ``filter_value``, in the scores' dtype."""
    return scores.masked_fill(~keep, filter_value)
