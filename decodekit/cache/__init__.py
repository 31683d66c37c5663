"""A compressed KV cache that evicts low-attention tokens: ``past_key_values=CompressedCache(model, budget=512)``."""

from decodekit.cache.compressed import CompressedCache
from decodekit.cache.layer import CompressedLayer
from decodekit.cache.observer import unbind
from decodekit.cache.policy import EvictionPolicy
from decodekit.cache.size import full_cache_bytes

__all__ = ["CompressedCache", "CompressedLayer", "EvictionPolicy", "full_cache_bytes", "unbind"]
