"""OpenAI-style frequency and presence penalties over the generated tokens."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import LogitsProcessor

from decodekit._validation import check_int
from decodekit.logits_processors._counting import occurrence_counts
from decodekit.logits_processors._rows import RowParameter, RowValues, check_scores
from decodekit.settings import PENALTY_RANGE


class FrequencyPresencePenaltyLogitsProcessor(LogitsProcessor):
    r"""Subtract ``count * frequency_penalty + (count > 0) * presence_penalty`` from each score.

    ``count`` is how many times the token occurs among the generated tokens: the positions of
    ``input_ids`` from ``prompt_length`` on (the semantics of the OpenAI API and vLLM). Positive
    values discourage repetition, negative ones encourage it.

    Args:
        frequency_penalty: in [-2, 2]; a float or one value per batch row (or per request).
        presence_penalty: in [-2, 2]; a float or one value per batch row (or per request).
        prompt_length: the length of the (padded) prompt in ``input_ids``; positions before it are
            not counted. 0 counts every position.

    Example:
        >>> import torch
        >>> from decodekit import FrequencyPresencePenaltyLogitsProcessor
        >>> processor = FrequencyPresencePenaltyLogitsProcessor(0.5, 1.0, prompt_length=1)
        >>> input_ids = torch.tensor([[2, 0, 0, 1]])  # prompt [2], generated [0, 0, 1]
        >>> processor(input_ids, torch.zeros(1, 3)).tolist()
        [[-2.0, -1.5, 0.0]]
    """

    supports_continuous_batching = False

    def __init__(
        self, frequency_penalty: RowValues = 0.0, presence_penalty: RowValues = 0.0, *, prompt_length: int
    ) -> None:
        low, high = PENALTY_RANGE
        self.frequency_penalty = RowParameter("frequency_penalty", frequency_penalty, low=low, high=high)
        self.presence_penalty = RowParameter("presence_penalty", presence_penalty, low=low, high=high)
        self.prompt_length = check_int("prompt_length", prompt_length, 0, " (the padded prompt length)")

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, vocab = check_scores(scores, "FrequencyPresencePenaltyLogitsProcessor")
        generated = input_ids[:, self.prompt_length :]
        if generated.shape[1] == 0:
            return scores
        generated, occurrences = occurrence_counts(generated, vocab, dtype=torch.float32)
        frequency = self.frequency_penalty.for_rows(rows, scores.device, torch.float32)
        presence = self.presence_penalty.for_rows(rows, scores.device, torch.float32)
        penalty = torch.where(occurrences > 0, occurrences * frequency + presence, 0.0)
        selected = scores.gather(1, generated)
        return scores.scatter(1, generated, (selected.float() - penalty).to(scores.dtype))


def from_strategy(values: Mapping[str, Any], context: Any) -> FrequencyPresencePenaltyLogitsProcessor:
    """The processor for a Strategy's ``frequency_penalty`` and ``presence_penalty``."""
    prompt_length = context.require_prompt_length("frequency_penalty and presence_penalty")
    return FrequencyPresencePenaltyLogitsProcessor(
        values.get("frequency_penalty", 0.0), values.get("presence_penalty", 0.0), prompt_length=prompt_length
    )
