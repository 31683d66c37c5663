"""How many bytes a full (uncompressed) KV cache holds: the baseline a compressed cache is judged by."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from decodekit.cache.quantize import Quantizer, rotation_block
from decodekit.settings import CODED_BITS


def attention_head_size(config: Any) -> int | None:
    """A text config's attention head size: its ``head_dim``, else the hidden size over the query heads;
    None when it says neither.

    Example:
        >>> from types import SimpleNamespace
        >>> attention_head_size(SimpleNamespace(hidden_size=64, num_attention_heads=4))
        16
    """
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and getattr(config, "num_attention_heads", None):
        head_dim = config.hidden_size // config.num_attention_heads
    return head_dim


def full_cache_bytes(
    model: Any, tokens: int, rows: int = 1, element_size: int | None = None, *, windows: bool = False
) -> int:
    """The bytes a full KV cache of ``tokens`` tokens per row holds for ``model`` (keys and values,
    every layer and KV head, in the model's parameter dtype, or ``element_size`` bytes per value).

    ``windows=True`` counts what generate's own cache (``DynamicCache(config=model.config)``) holds: a
    sliding-window layer at most its last ``window - 1`` tokens. The default counts every token in every layer.

    Example:
        >>> from types import SimpleNamespace
        >>> import torch
        >>> config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=4, head_dim=8)
        >>> config.get_text_config = lambda: config
        >>> model = SimpleNamespace(config=config, parameters=lambda: iter([torch.zeros(1)]))
        >>> full_cache_bytes(model, tokens=10)  # 2 (K and V) * 2 layers * 4 heads * 8 * 10 tokens * 4 bytes
        5120
    """
    config = model.config.get_text_config()
    head_dim = attention_head_size(config)
    element = element_size or next(model.parameters()).element_size()
    held = config.num_hidden_layers * tokens
    if windows:
        held = sum(min(tokens, cap) for cap in layer_caps(model.config))
    return 2 * config.num_key_value_heads * head_dim * held * rows * element


def layer_caps(config: Any) -> list[float]:
    """Per layer, the most tokens generate's own cache for ``config`` keeps: a sliding-window layer's
    ``window - 1`` (``DynamicSlidingWindowLayer``), ``inf`` elsewhere.

    Example:
        >>> from transformers import MistralConfig
        >>> layer_caps(MistralConfig(num_hidden_layers=2, sliding_window=16))
        [15, 15]
    """
    from transformers import DynamicCache

    layers = config.get_text_config().num_hidden_layers
    caps = [getattr(layer, "sliding_window", None) for layer in DynamicCache(config=config).layers][:layers]
    caps += [None] * (layers - len(caps))
    return [math.inf if window is None else window - 1 for window in caps]


# The least room a decoding step reserves after a layer's entries when it finds none, so that a layer whose
# target grows with the tokens seen (a ratio, a size in bytes) and evicts at every step copies its entries into
# a larger tensor once every few steps of growth, not at every one.
GROWTH_ROOM = 4


def reserved_room(eviction_interval: int, grows: bool) -> int:
    """The slots a decoding step that finds no room reserves after the stored entries, its own included: one per
    step until the next eviction, and at least ``GROWTH_ROOM`` when the target ``grows`` with the tokens seen.

    Example:
        >>> reserved_room(8, grows=False), reserved_room(1, grows=False), reserved_room(1, grows=True)
        (8, 1, 4)
    """
    return max(eviction_interval, GROWTH_ROOM) if grows else eviction_interval


# A refit entry's log-mass bias (``storage.BIAS_DTYPE``), held by the layers whose prompt entries are refit.
BIAS_BYTES = 2


@dataclass(frozen=True)
class EntryBytes:
    """What one layer of a compressed cache holds per row and KV head, in bytes: per kept token (keys,
    values, their scales and the bookkeeping), whatever it holds however few tokens it keeps (the exact
    recent ring, waiting queries, reserved slots), and a full 16-bit cache's per token. ``units`` is how
    many (layer, KV head) pairs a row has.

    The biases of refit layers (``matched_layers``) are bounded two ways, as each size needs: a refit head holds at
    most one per token seen (``biases_per_seen``, per pair and token seen: a size that grows with the tokens), and
    a row holds at most one per kept token (``biases_per_kept``: a fixed size).

    ``caps``: per layer, the most tokens the layer ever holds (a sliding window's ``window - 1``, as transformers'
    own cache holds; ``inf`` for full attention), which both the full cache and this one respect: a layer keeps
    ``min(tokens, cap)`` where the others keep ``tokens``.

    Example:
        >>> EntryBytes(kept=100, fixed=1000, full=256, units=2).tokens_within(10_000)
        40
        >>> windowed = EntryBytes(kept=100, fixed=1000, full=256, units=2, caps=(10.0, math.inf))
        >>> windowed.tokens_within(10_000), float(windowed.held(np.array([70.0]))[0])  # (10 + 70) / 2 = 40 held
        (70, 40.0)
    """

    kept: float
    fixed: float
    full: float
    units: int
    biases_per_seen: float = 0.0
    biases_per_kept: float = 0.0
    caps: tuple[float, ...] = (math.inf,)

    def held(self, tokens: np.ndarray) -> np.ndarray:
        """The mean over layers of what a layer holds when a full-attention layer holds ``tokens``: ``min(tokens,
        cap)`` averaged (float64)."""
        tokens = np.asarray(tokens, dtype=np.float64)
        return np.mean([np.minimum(tokens, cap) for cap in self.caps], axis=0)

    def tokens_for(self, held: np.ndarray) -> np.ndarray:
        """The inverse of ``held``: the most tokens a full-attention layer may keep so that the layers' mean holding
        is ``held`` (``inf`` where every layer's cap fits)."""
        held = np.asarray(held, dtype=np.float64)
        caps = sorted(self.caps)
        count = len(caps)
        result = np.full_like(held, np.inf)
        below = 0.0  # the sum of the caps below the segment: there, mean = (below + (count - index) * tokens) / count
        for index, cap in enumerate(caps):
            tokens = (held * count - below) / (count - index)
            result = np.where(np.isinf(result) & (tokens <= cap), tokens, result)  # (the first segment it falls in)
            if math.isinf(cap):
                break
            below += cap
        return result

    def tokens_within(self, row_bytes: float) -> int:
        """How many tokens a full-attention layer keeps so that one row (all its layers and heads) fits in
        ``row_bytes`` bytes (each windowed layer keeping at most its cap)."""
        held = (row_bytes / self.units - self.fixed) / (self.kept + self.biases_per_kept)
        tokens = float(self.tokens_for(np.array([held]))[0])
        return math.floor(min(tokens, 2**62))


def entry_bytes(
    model: Any,
    *,
    kv_bits: int | None,
    group_size: int,
    key_bits: int | None = None,
    residual_length: int,
    eviction_interval: int,
    value_norms: bool = True,
    matched_layers: int = 0,
    caps: tuple[float, ...] = (math.inf,),
    smooth_keys: bool = False,
) -> EntryBytes:
    """The :class:`EntryBytes` of a compressed cache for ``model`` storing ``kv_bits`` per value (None: the
    model's dtype; keys in ``key_bits`` when given) in groups of ``group_size`` channels, holding the last
    ``residual_length`` tokens exact besides (quantized storage) and scoring the decoding steps every
    ``eviction_interval``, with each entry's value norm when ``value_norms`` (eviction ranks by it) and a bias
    per entry in the first ``matched_layers`` layers; ``caps``: per layer, the most tokens it holds (``EntryBytes``);
    ``smooth_keys``: coded keys less their mean key (held per row and KV head in float32, as read and as coded)."""
    config = model.config.get_text_config()
    head_dim = attention_head_size(config)
    kv_heads, query_heads = config.num_key_value_heads, config.num_attention_heads
    element = next(model.parameters()).element_size()
    stored = 2 if kv_bits is not None else element  # keys and values, or the scales, in 16 bits
    widths = (key_bits or kv_bits, kv_bits)
    coded = [
        Quantizer(bits, group_size).entry_bytes(head_dim, stored) if bits in CODED_BITS else head_dim * stored
        for bits in widths
    ]
    units = config.num_hidden_layers * kv_heads
    ring = 0.0
    if set(CODED_BITS) & set(widths):  # exact recent keys and values and their positions
        ring = 2 * residual_length * head_dim * stored + residual_length * 4 / kv_heads
    if widths[0] in CODED_BITS:  # the Hadamard matrix that rotates coded keys, one for the whole cache
        ring += rotation_block(head_dim) ** 2 * 4 / units
        if smooth_keys:
            ring += 2 * head_dim * 4
    bookkeeping = 4 + (4 if value_norms else 0) + 4  # score, value norm, position
    # The queries of the steps waiting to be scored, with their rotation (held in 16 bits when keys and values are
    # stored in 16 bits or fewer), and the reserved slots.
    waiting = eviction_interval * (query_heads * head_dim + 2 * head_dim) * min(stored, element) / kv_heads
    kept = sum(coded) + bookkeeping
    reserved = (reserved_room(eviction_interval, grows=True) + 1) * kept  # a size in bytes grows with the tokens
    padding = 32 / kv_heads  # the row's padding and count of tokens seen, each segment's start and length
    biased = min(matched_layers, config.num_hidden_layers) * kv_heads  # the (layer, KV head) pairs that hold biases
    return EntryBytes(
        kept, ring + waiting + reserved + padding, 2 * head_dim * 2, units,
        biases_per_seen=BIAS_BYTES * biased / units, biases_per_kept=BIAS_BYTES if biased else 0.0, caps=caps,
    )  # fmt: skip
