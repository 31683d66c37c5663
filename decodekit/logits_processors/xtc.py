"""XTC ("exclude top choices"): now and then, remove the most likely tokens to leave room for others."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import LogitsProcessor

from decodekit._validation import check_int
from decodekit.logits_processors._rows import (
    TEMPERATURE_RANGE,
    RowParameter,
    RowValues,
    check_scores,
    expand_rows,
    fast_logsumexp,
    integer_rows,
)
from decodekit.logits_processors.seeded import uniform_draws

XTC_STREAM = 2  # keeps XTC's coin flips apart from the sampling noise drawn from the same seed


class XTCLogitsProcessor(LogitsProcessor):
    r"""Exclude top choices (XTC, from text-generation-webui and llama.cpp).

    With probability ``probability`` per row and step, every token whose probability is at
    least ``threshold`` is removed except the least likely of them, so the text leaves the most
    predictable path while staying on a plausible one. Nothing happens in a row where fewer than
    two tokens reach the threshold. Probabilities are those of the distribution at
    ``temperature`` (the one you sample at, as for ``MinPLogitsProcessor``).

    The coin flips are a hash of (row seed, step), drawn on the scores' device with no host
    sync: a row flips the same coins alone or in any batch. Without ``seeds`` every row uses
    one seed taken from torch's random state when the processor is built (so ``set_seed`` makes
    runs repeatable).

    Args:
        threshold: the probability from which a token counts as a top choice; in [0, 1].
        probability: the chance that XTC acts on a row at a step; in [0, 1].
        temperature: the temperature the probabilities are judged at; float or per row.
        seeds: one integer per batch row (or per request); optional.
        prompt_length: the padded prompt's length, which makes the step count start at 0.

    Example:
        >>> import torch
        >>> scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
        >>> xtc = XTCLogitsProcessor(threshold=0.1, probability=1.0)
        >>> xtc(torch.zeros(1, 1, dtype=torch.long), scores).isfinite().tolist()
        [[False, False, True, True]]
    """

    supports_continuous_batching = False

    def __init__(
        self,
        threshold: RowValues,
        probability: RowValues,
        *,
        temperature: RowValues = 1.0,
        seeds: Sequence[int] | torch.Tensor | None = None,
        prompt_length: int = 0,
    ) -> None:
        self.threshold = RowParameter("xtc_threshold", threshold, low=0.0, high=1.0)
        self.probability = RowParameter("xtc_probability", probability, low=0.0, high=1.0)
        self.temperature = RowParameter("temperature", temperature, low=TEMPERATURE_RANGE[0], high=TEMPERATURE_RANGE[1])
        if seeds is None:
            seeds = [int(torch.randint(0, 2**31 - 1, (1,), generator=None).item())]  # built once, on the host
        self.seeds = integer_rows("seeds", seeds)
        self.prompt_length = check_int("prompt_length", prompt_length, 0)
        self._lowest_threshold = float(self.threshold.values.min())

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, vocab = check_scores(scores, "XTCLogitsProcessor")
        device = scores.device
        # At most 1 / threshold tokens reach the threshold: only the k best can be top choices.
        k = vocab if self._lowest_threshold <= 0 else min(vocab, int(1.0 / self._lowest_threshold) + 1)
        scaled = scores.float() / self.temperature.for_rows(rows, device, torch.float32)
        best, index = scaled.topk(k, dim=-1)
        probabilities = (best - fast_logsumexp(scaled)).exp()
        top = probabilities >= self.threshold.for_rows(rows, device, torch.float32)
        # The least likely top choice stays: the smallest probability among the top ones.
        least = torch.where(top, probabilities, math.inf).amin(dim=-1, keepdim=True)
        step = input_ids.shape[1] - self.prompt_length
        flips = uniform_draws(expand_rows(self.seeds, rows, "seeds"), step, device, XTC_STREAM)
        acts = flips[:, None] < self.probability.for_rows(rows, device, torch.float32)
        enough = top.sum(dim=-1, keepdim=True) >= 2
        removed = top & (probabilities > least) & acts & enough
        kept = scores.gather(1, index).masked_fill(removed, -math.inf)
        return scores.scatter(1, index, kept)


def from_strategy(values: Mapping[str, Any], context: Any) -> XTCLogitsProcessor:
    """The processor for a Strategy's ``xtc_threshold`` and ``xtc_probability`` (0.5 by default)."""
    return XTCLogitsProcessor(
        values["xtc_threshold"], values.get("xtc_probability", 0.5), temperature=context.temperature,
        seeds=context.row_seeds, prompt_length=context.prompt_length or 0,
    )  # fmt: skip
