"""decodekit: decoding strategies for Hugging Face transformers.

Example:
    >>> from decodekit import Strategy, load_model
    >>> model, tokenizer = load_model()  # doctest: +SKIP
    >>> Strategy(temperature=0.8).generate_kwargs()
    {'do_sample': True, 'temperature': 0.8, 'top_k': 0, 'top_p': 1.0}
"""

from decodekit import logits_processors as processors
from decodekit.cache import CompressedCache
from decodekit.decoders import beam_search
from decodekit.generation import encode_prompts, generate_text
from decodekit.logits_processors import (
    FrequencyPresencePenaltyLogitsProcessor,
    GumbelSamplingLogitsProcessor,
    MinPLogitsProcessor,
    StagedRepetitionPenaltyLogitsProcessor,
)
from decodekit.models import ModelLoadError, load_model
from decodekit.strategies import Strategy

__all__ = [
    "CompressedCache",
    "FrequencyPresencePenaltyLogitsProcessor",
    "GumbelSamplingLogitsProcessor",
    "MinPLogitsProcessor",
    "ModelLoadError",
    "StagedRepetitionPenaltyLogitsProcessor",
    "Strategy",
    "beam_search",
    "encode_prompts",
    "generate_text",
    "load_model",
    "processors",
]
__version__ = "0.1.0"
