"""Logits processors for ``model.generate(logits_processor=LogitsProcessorList([...]))``.

Each is vectorized over the batch, keeps the scores' dtype and device, accepts per-row
parameters, and never removes every token of a row.
"""

from decodekit.logits_processors.frequency import FrequencyPresencePenaltyLogitsProcessor
from decodekit.logits_processors.min_p import MinPLogitsProcessor
from decodekit.logits_processors.repetition import (
    StagedRepetitionPenaltyLogitsProcessor,
    parse_stages,
    punctuation_token_ids,
)
from decodekit.logits_processors.seeded import GumbelSamplingLogitsProcessor

__all__ = [
    "FrequencyPresencePenaltyLogitsProcessor",
    "GumbelSamplingLogitsProcessor",
    "MinPLogitsProcessor",
    "StagedRepetitionPenaltyLogitsProcessor",
    "parse_stages",
    "punctuation_token_ids",
]
