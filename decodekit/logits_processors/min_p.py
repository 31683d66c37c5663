"""Min-p filtering computed in logit space, with the temperature it will be sampled at."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from transformers import LogitsProcessor

from decodekit._validation import check_int
from decodekit.logits_processors._rows import (
    FLOAT32_MIN,
    TEMPERATURE_RANGE,
    RowParameter,
    RowValues,
    check_filter_value,
    check_scores,
    expand_rows,
    keep_bound,
)

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class MinPLogitsProcessor(LogitsProcessor):
    r"""Keep the tokens whose probability is at least ``min_p`` times the most likely token's.

    The probabilities are those of the distribution at ``temperature``: generate applies its own
    temperature *after* user processors, so pass the temperature you sample at and min-p acts on
    the tempered distribution, as llama.cpp and vLLM do. No softmax is needed: with ``l`` the
    logits and ``T`` the temperature, ``p_i >= min_p * p_max`` is ``l_i >= l_max + T * ln(min_p)``.
    With ``temperature=1``, the default ``filter_value`` and float32 scores, the result equals
    transformers' ``MinPLogitsWarper`` on the same scores, bit for bit. Otherwise two things
    differ: a finite ``filter_value`` never raises a removed score that is already below it (the
    warper sets every removed score to it), and half-precision scores are judged in float32 here,
    while the warper takes its softmax in the scores' dtype, so a token within rounding of the
    threshold may be kept by one and removed by the other.

    Args:
        min_p: in [0, 1]; a float, or a 1-D tensor with one value per batch row (or per request
            when generate expands requests into beams / return sequences). 0 keeps every token.
        min_tokens_to_keep: always keep at least this many of the most likely tokens; >= 1.
        temperature: the temperature of the distribution min-p is judged on; in [1e-6, 1e4], float or per row.
        filter_value: the score given to removed tokens (never raises a score already below it).

    Example:
        >>> import torch
        >>> from transformers import LogitsProcessorList
        >>> from decodekit import MinPLogitsProcessor
        >>> scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
        >>> MinPLogitsProcessor(min_p=0.2)(None, scores).isfinite().tolist()
        [[True, True, True, False]]
        >>> processors = LogitsProcessorList([MinPLogitsProcessor(0.1, temperature=0.7)])
        >>> # model.generate(**inputs, do_sample=True, temperature=0.7, logits_processor=processors)
    """

    # Row-independent with one min_p and one temperature; per-row values follow the batch's rows.
    supports_continuous_batching = False

    def __init__(
        self,
        min_p: RowValues,
        min_tokens_to_keep: int = 1,
        temperature: RowValues = 1.0,
        filter_value: float = -math.inf,
    ) -> None:
        self.min_p = RowParameter("min_p", min_p, low=0.0, high=1.0)
        self.temperature = RowParameter("temperature", temperature, low=TEMPERATURE_RANGE[0], high=TEMPERATURE_RANGE[1])
        check_int("min_tokens_to_keep", min_tokens_to_keep, 1)
        self.min_tokens_to_keep = min_tokens_to_keep
        self.filter_value = check_filter_value(filter_value)
        # temperature * ln(min_p), the threshold's distance below the top logit; ln(0) floored to a finite value.
        self._log_min_p = torch.log(self.min_p.values).clamp(min=FLOAT32_MIN)
        self._scalar_offset: float | None = None
        if self.min_p.is_scalar and self.temperature.is_scalar:
            self._scalar_offset = max(self.temperature.scalar * float(self._log_min_p[0]), FLOAT32_MIN)
            self.supports_continuous_batching = True
        self._row_offsets: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _offset(self, rows: int, device: torch.device) -> float | torch.Tensor:
        """``temperature * ln(min_p)`` as a float, or a ``[rows, 1]`` float32 tensor built once per shape."""
        if self._scalar_offset is not None:
            return self._scalar_offset
        key = (rows, device)
        if key not in self._row_offsets:
            log_min_p = expand_rows(self._log_min_p, rows, "min_p")
            temperature = expand_rows(self.temperature.values, rows, "temperature")
            offset = (temperature * log_min_p).clamp(min=FLOAT32_MIN)
            self._row_offsets[key] = offset.to(device=device, dtype=torch.float32)[:, None]
        return self._row_offsets[key]

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.FloatTensor) -> torch.FloatTensor:
        # Judge in float32 at least, so a half-precision threshold is not rounded onto the scores' grid;
        # clamped to finite values so that an infinite top score cannot produce inf - inf.
        check_scores(scores, "MinPLogitsProcessor")
        top = scores.amax(dim=-1, keepdim=True).float()
        threshold = (top + self._offset(scores.shape[0], scores.device)).clamp_(-FLOAT32_MAX, FLOAT32_MAX)
        bound = keep_bound(scores, threshold)  # +inf to keep, -inf to remove
        if self.min_tokens_to_keep > 1:
            k = min(self.min_tokens_to_keep, scores.shape[-1])
            bound.scatter_(-1, torch.topk(scores, k, dim=-1).indices, math.inf)
        if self.filter_value != -math.inf:
            bound.clamp_(min=self.filter_value)
        # The element-wise minimum returns kept scores bit for bit and lowers removed ones to the bound.
        return torch.minimum(scores, bound, out=bound).to(scores.dtype)


def from_strategy(values: Mapping[str, Any], context: Any) -> MinPLogitsProcessor:
    """The processor for a Strategy's ``min_p``, judged at its temperature."""
    return MinPLogitsProcessor(values["min_p"], temperature=context.temperature)
