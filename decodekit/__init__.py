"""decodekit: decoding strategies for Hugging Face transformers.

Its names load on first use, so ``decodekit --help`` answers without importing torch.

Example:
    >>> from decodekit import Strategy, load_model
    >>> model, tokenizer = load_model()  # doctest: +SKIP
    >>> Strategy(temperature=0.8).generate_kwargs()
    {'do_sample': True, 'temperature': 0.8, 'top_k': 0, 'top_p': 1.0}
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_HOMES = {
    "CompressedCache": "decodekit.cache",
    "XTCLogitsProcessor": "decodekit.logits_processors",
    "TopNSigmaLogitsProcessor": "decodekit.logits_processors",
    "AdaptivePLogitsProcessor": "decodekit.logits_processors",
    "EpsilonLogitsProcessor": "decodekit.logits_processors",
    "EtaLogitsProcessor": "decodekit.logits_processors",
    "TopHLogitsProcessor": "decodekit.logits_processors",
    "TypicalLogitsProcessor": "decodekit.logits_processors",
    "MirostatLogitsProcessor": "decodekit.logits_processors",
    "DRYLogitsProcessor": "decodekit.logits_processors",
    "FrequencyPresencePenaltyLogitsProcessor": "decodekit.logits_processors",
    "GumbelSamplingLogitsProcessor": "decodekit.logits_processors",
    "MinKLogitsProcessor": "decodekit.logits_processors",
    "MinPLogitsProcessor": "decodekit.logits_processors",
    "PLessLogitsProcessor": "decodekit.logits_processors",
    "ModelLoadError": "decodekit.models",
    "StagedRepetitionPenaltyLogitsProcessor": "decodekit.logits_processors",
    "Strategy": "decodekit.strategies",
    "beam_search": "decodekit.decoders",
    "encode_prompts": "decodekit.generation",
    "generate_text": "decodekit.generation",
    "load_model": "decodekit.models",
}
__all__ = [
    "AdaptivePLogitsProcessor",
    "CompressedCache",
    "DRYLogitsProcessor",
    "EpsilonLogitsProcessor",
    "EtaLogitsProcessor",
    "FrequencyPresencePenaltyLogitsProcessor",
    "GumbelSamplingLogitsProcessor",
    "MinKLogitsProcessor",
    "MinPLogitsProcessor",
    "MirostatLogitsProcessor",
    "ModelLoadError",
    "PLessLogitsProcessor",
    "StagedRepetitionPenaltyLogitsProcessor",
    "Strategy",
    "TopHLogitsProcessor",
    "TopNSigmaLogitsProcessor",
    "TypicalLogitsProcessor",
    "XTCLogitsProcessor",
    "beam_search",
    "encode_prompts",
    "generate_text",
    "load_model",
]

if TYPE_CHECKING:
    from decodekit.cache import CompressedCache
    from decodekit.decoders import beam_search
    from decodekit.generation import encode_prompts, generate_text
    from decodekit.logits_processors import (
        AdaptivePLogitsProcessor,
        DRYLogitsProcessor,
        EpsilonLogitsProcessor,
        EtaLogitsProcessor,
        FrequencyPresencePenaltyLogitsProcessor,
        GumbelSamplingLogitsProcessor,
        MinKLogitsProcessor,
        MinPLogitsProcessor,
        MirostatLogitsProcessor,
        PLessLogitsProcessor,
        StagedRepetitionPenaltyLogitsProcessor,
        TopHLogitsProcessor,
        TopNSigmaLogitsProcessor,
        TypicalLogitsProcessor,
        XTCLogitsProcessor,
    )
    from decodekit.models import ModelLoadError, load_model
    from decodekit.strategies import Strategy


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'decodekit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
