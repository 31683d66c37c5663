"""decodekit's length-normalized beam search in the Hub ``custom_generate`` format.

``model.generate(..., custom_generate="<this folder>", trust_remote_code=True, num_beams=4,
length_normalization="gnmt", length_alpha=0.6)`` runs it; it needs ``pip install decodekit``.
"""

from transformers.generation.utils import GenerationMixin

from decodekit.decoders.beam_search import beam_search


def generate(model, *args, **kwargs):
    """generate with decodekit's beam search as the decoding loop."""
    return GenerationMixin.generate(model, *args, custom_generate=beam_search, **kwargs)
