"""p-less sampling: keep the tokens at least as likely as two independent draws are to agree."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from decodekit.logits_processors._entropy import TemperatureFilter, at_temperature, filtered
from decodekit.logits_processors._rows import RowParameter, RowValues, check_scores
from decodekit.settings import P_LESS_ORDER_RANGE

# A relative slack on the threshold, so that a flat distribution (every p equal to the threshold) keeps
# every token whatever the summation's rounding.
SLACK = 1e-5


class PLessLogitsProcessor(TemperatureFilter):
    r"""p-less sampling (Tan, Wu and Howard, ICLR 2026, "p-less Sampling: A Robust Hyperparameter-Free
    Approach for LLM Decoding", arXiv 2509.23234), with per-row parameters.

    At the temperature the token will be sampled at, a token is kept when its probability is at least
    ``L = sum_v p(v)^2``, the chance that two independent draws pick the same token: a peaked row keeps
    little more than its best token, a flat one most of its tokens, with no threshold to tune. ``order``
    generalizes it to ``L = (sum_v p(v)^q)^(1 / (q - 1))``, the exponential of minus the Rényi entropy
    of order ``q`` (2: the paper's p-less; higher orders keep fewer tokens, approaching greedy). Since
    ``L <= max p``, the likeliest token is always kept.

    Args:
        order: the Rényi order ``q``, in (1, 64]; 2 (the default) is p-less. One value or one per row.
        temperature: the temperature the distribution is judged at, in [1e-6, 1e4]; one or per row.
        filter_value: the score given to removed tokens (default -inf).

    Example:
        >>> import torch
        >>> scores = torch.log(torch.tensor([[0.6, 0.3, 0.07, 0.03]]))  # sum of squares 0.4558
        >>> PLessLogitsProcessor()(None, scores).isfinite().tolist()
        [[True, False, False, False]]
    """

    def __init__(self, order: RowValues = 2.0, temperature: RowValues = 1.0, filter_value: float = -math.inf) -> None:
        low, high = P_LESS_ORDER_RANGE
        super().__init__(RowParameter("p_less", order, low=low, high=high, low_open=True), temperature, filter_value)
        self.order = self.parameter

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, _ = check_scores(scores, "PLessLogitsProcessor")
        log_probs = at_temperature(scores, self.temperature).log_softmax(dim=-1)
        order = self.order.for_rows(rows, scores.device, torch.float32)
        # log L = logsumexp(q log p) / (q - 1), in log space so that no power underflows.
        log_threshold = (log_probs * order).logsumexp(dim=-1, keepdim=True) / (order - 1)
        keep = (log_probs >= log_threshold + math.log1p(-SLACK)) | (scores >= scores.amax(dim=-1, keepdim=True))
        return filtered(scores, keep, self.filter_value)


def from_strategy(values: Mapping[str, Any], context: Any) -> PLessLogitsProcessor:
    """The processor for a Strategy's ``p_less`` (the order), judged at its temperature."""
    return PLessLogitsProcessor(values["p_less"], temperature=context.temperature)
