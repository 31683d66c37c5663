"""Decoders for ``model.generate(custom_generate=...)``: length-normalized beam search.

``HUB_FOLDER`` is the same decoder in the Hub's ``custom_generate`` folder format, for
``model.generate(custom_generate=str(HUB_FOLDER), trust_remote_code=True)`` or for uploading.
"""

from pathlib import Path

from decodekit.decoders.beam_search import BeamSearchStep, beam_search
from decodekit.decoders.length_normalization import NORMALIZATIONS, LengthNormalization
from decodekit.decoders.streaming import BeamProgress, BeamSearchStreamer

HUB_FOLDER = Path(__file__).parent / "hub"

__all__ = [
    "HUB_FOLDER",
    "NORMALIZATIONS",
    "BeamProgress",
    "BeamSearchStep",
    "BeamSearchStreamer",
    "LengthNormalization",
    "beam_search",
]
