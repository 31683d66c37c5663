"""Logits processors for ``model.generate(logits_processor=LogitsProcessorList([...]))``.

Each is vectorized over the batch, keeps the scores' dtype and device, accepts per-row
parameters, and never removes every token of a row.
"""

from decodekit.logits_processors.adaptive_p import AdaptivePLogitsProcessor
from decodekit.logits_processors.dry import DRYLogitsProcessor, breaker_token_ids
from decodekit.logits_processors.epsilon import EpsilonLogitsProcessor
from decodekit.logits_processors.eta import EtaLogitsProcessor
from decodekit.logits_processors.frequency import FrequencyPresencePenaltyLogitsProcessor
from decodekit.logits_processors.min_k import MinKLogitsProcessor
from decodekit.logits_processors.min_p import MinPLogitsProcessor
from decodekit.logits_processors.mirostat import MirostatLogitsProcessor
from decodekit.logits_processors.p_less import PLessLogitsProcessor
from decodekit.logits_processors.repetition import (
    StagedRepetitionPenaltyLogitsProcessor,
    parse_stages,
    punctuation_token_ids,
)
from decodekit.logits_processors.seeded import GumbelSamplingLogitsProcessor
from decodekit.logits_processors.top_h import TopHLogitsProcessor
from decodekit.logits_processors.top_n_sigma import TopNSigmaLogitsProcessor
from decodekit.logits_processors.typical import TypicalLogitsProcessor
from decodekit.logits_processors.xtc import XTCLogitsProcessor

__all__ = [
    "AdaptivePLogitsProcessor",
    "DRYLogitsProcessor",
    "EpsilonLogitsProcessor",
    "EtaLogitsProcessor",
    "FrequencyPresencePenaltyLogitsProcessor",
    "GumbelSamplingLogitsProcessor",
    "MinKLogitsProcessor",
    "MinPLogitsProcessor",
    "MirostatLogitsProcessor",
    "PLessLogitsProcessor",
    "StagedRepetitionPenaltyLogitsProcessor",
    "TopHLogitsProcessor",
    "TopNSigmaLogitsProcessor",
    "TypicalLogitsProcessor",
    "XTCLogitsProcessor",
    "breaker_token_ids",
    "parse_stages",
    "punctuation_token_ids",
]
