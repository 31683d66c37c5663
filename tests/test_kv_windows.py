"""Sliding-window layers: a windowed layer never holds a token its window has passed, sizes count against what
transformers' own cache holds for the model (windowed layers at their window), and the cache never holds more bytes
than that cache. Oracles: each held entry's position against the window, and ``DynamicCache(config=...)`` fed the
same passes."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from decodekit.cache import CompressedCache, full_cache_bytes
from tests.families import build_family_model

SIZES = {
    "budget": {"budget": 24, "sink_tokens": 2, "recent_tokens": 8},
    "ratio": {"compression_ratio": 0.5, "sink_tokens": 2, "recent_tokens": 4},
    "memory fraction": {"memory_fraction": 0.5, "sink_tokens": 2, "recent_tokens": 4},
    "max bytes": {"max_bytes": 20_000, "sink_tokens": 2, "recent_tokens": 4},
    "4-bit budget": {"budget": 24, "sink_tokens": 2, "recent_tokens": 8, "kv_bits": 4},
    "reconstruction": {"compression_ratio": 0.5, "scoring": "reconstruction", "sink_tokens": 2, "recent_tokens": 4},
}


def _cache_bytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _passes(model, cache, prompt: int, steps: int):
    """The prompt's pass, then greedy steps by hand; yields after each pass (the tokens seen so far)."""
    ids = torch.randint(3, 384, (1, prompt), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        token = model(ids, past_key_values=cache).logits[:, -1:].argmax(dim=-1)
        yield prompt
        for step in range(steps):
            position = torch.tensor([[prompt + step]])
            token = model(token, past_key_values=cache, position_ids=position).logits[:, -1:].argmax(dim=-1)
            yield prompt + step + 1


@pytest.mark.parametrize("family", ["gemma3", "mistral-sliding"])
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("prompt", [6, 40])
def test_a_windowed_layer_holds_only_its_window_and_never_more_than_generates_cache(family, size, prompt):
    """At every pass, prompts shorter and longer than the window: a windowed layer holds no token its window has
    passed and at most ``window - 1``, and no layer holds more tokens than generate's own cache holds there."""
    model = build_family_model(family)
    if family == "mistral-sliding" and size == "memory fraction":  # every layer windowed: no fraction fits
        with pytest.raises(ValueError, match="leaves no room"):
            CompressedCache(model, **SIZES[size])
        return
    cache = CompressedCache(model, **SIZES[size])
    full = DynamicCache(config=model.config)
    windowed = [layer for layer in cache.layers if layer.window is not None]
    assert windowed  # (both families have windowed layers: every layer of Mistral's, one of Gemma 3's two)
    for seen, _ in zip(_passes(model, cache, prompt, 20), _passes(model, full, prompt, 20), strict=True):
        for layer in windowed:
            positions = layer.positions()
            held = positions[positions >= 0]
            assert int(layer.storage.lengths_host.max()) <= layer.window - 1
            assert bool((held > seen - layer.window).all()), (seen, held.min())  # none its window passed
        for ours, theirs in zip(cache.layers, full.layers, strict=True):
            assert int(ours.storage.lengths_host.max()) <= theirs.keys.shape[-2]


SHARED = {
    "uniform": {},
    "shared by heads": {"scoring": "reconstruction", "allocation": "heads"},
    "shared by layers": {"scoring": "reconstruction", "allocation": "layers"},
}


@pytest.mark.parametrize("fraction", [0.5, 0.25])
@pytest.mark.parametrize("allocation", list(SHARED))
def test_a_size_in_bytes_counts_against_generates_cache_in_16_bits(fraction, allocation):
    """Oracle: ``DynamicCache(config=...)`` fed the same passes, its bytes counted in 16 bits (the windowed layer
    holding its window): on Gemma 3's layers, past a 300-token prompt, the compressed cache holds at most
    ``memory_fraction`` of them at every pass, whether every layer keeps the even share or the layers share the
    size (a windowed layer's share counted at its window), and ``max_bytes`` at most that many."""
    model = build_family_model("gemma3")
    cache = CompressedCache(model, memory_fraction=fraction, sink_tokens=2, recent_tokens=4, **SHARED[allocation])
    full = DynamicCache(config=model.config)
    for seen, _ in zip(_passes(model, cache, 300, 20), _passes(model, full, 300, 20), strict=True):
        full_16_bits = _cache_bytes(full) // 2  # (the model is float32)
        assert cache.memory_bytes() <= fraction * full_16_bits, seen
    limit = 30_000
    cache = CompressedCache(model, max_bytes=limit, sink_tokens=2, recent_tokens=4)
    for _ in _passes(model, cache, 300, 20):
        assert cache.memory_bytes() <= limit


@pytest.mark.parametrize("allocation", list(SHARED))
def test_a_size_in_bytes_below_the_floor_holds_the_floor_of_every_layer_and_head(allocation):
    """A twentieth of generate's own 16-bit cache after a 300-token prompt is less than the floor takes (the sinks
    and the recent window, 6 tokens, in every layer and KV head): at every pass each layer and head, the windowed one
    included, keeps the floor (one more where a shared count rounds up), and the windowed layer no token its window
    has passed."""
    model = build_family_model("gemma3")
    cache = CompressedCache(model, memory_fraction=0.05, sink_tokens=2, recent_tokens=4, **SHARED[allocation])
    full = DynamicCache(config=model.config)
    for seen, _ in zip(_passes(model, cache, 300, 12), _passes(model, full, 300, 12), strict=True):
        assert cache.memory_bytes() > 0.05 * _cache_bytes(full) // 2  # (the floor does not fit the fraction here)
        for layer in cache.layers:
            lengths = layer.storage.lengths_host
            assert int(lengths.min()) >= 6 and int(lengths.max()) <= 7, (seen, lengths.tolist())
            if layer.window is not None:
                held = layer.positions()
                assert bool((held[held >= 0] > seen - layer.window).all())


def test_a_size_in_bytes_that_cannot_hold_the_floor_is_refused_naming_the_window():
    """Every layer of this Mistral slides a 10-token window: no fraction of that holds a layer's fewest tokens, and
    a byte size below the floor's bytes is refused, each with the smallest allowed value."""
    model = build_family_model("mistral-sliding")
    with pytest.raises(ValueError, match=r"memory_fraction=0\.5 leaves no room .* sliding window of 10 tokens"):
        CompressedCache(model, memory_fraction=0.5)
    with pytest.raises(ValueError, match=r"max_bytes=100 cannot hold .*: the smallest allowed is \d+"):
        CompressedCache(model, max_bytes=100)


@pytest.mark.parametrize("family", ["gemma3", "mistral-sliding"])
def test_a_budget_below_the_floor_is_refused_naming_the_smallest_allowed_and_the_window(family):
    model = build_family_model(family)
    with pytest.raises(ValueError, match=r"budget must be an integer >= 36 .*got 20: this model's sliding window "
                                         r"holds 9 tokens in \d of its 2 layers"):
        CompressedCache(model, budget=20)
    llama = build_family_model("llama")
    with pytest.raises(ValueError, match=r"got 20$"):  # (no window to name)
        CompressedCache(llama, budget=20)


@pytest.mark.parametrize("family", ["gemma3", "mistral-sliding"])
def test_sizes_count_against_the_window_the_full_cache_holds(family):
    """A ratio keeps its share of what a windowed layer would hold (its window), a budget above the window keeps
    the window, and a full-attention layer keeps the ratio of every token seen; by hand."""
    model = build_family_model(family)
    for options, expected in (({"compression_ratio": 0.5}, {9: 5, None: 20}), ({"budget": 36}, {9: 9, None: 36})):
        cache = CompressedCache(model, sink_tokens=2, recent_tokens=2, **options)
        for _ in _passes(model, cache, 40, 0):
            pass
        for layer in cache.layers:
            assert int(layer.storage.lengths_host.max()) == expected[layer.cap]


@pytest.mark.parametrize("family", ["gemma3", "mistral-sliding", "llama"])
@pytest.mark.parametrize("prompt", [1, 6, 40])
def test_full_cache_bytes_with_windows_counts_what_generates_cache_holds(family, prompt):
    """Oracle: ``DynamicCache(config=...)`` fed the same passes; ``windows=True`` gives its bytes at every pass (in
    the model's dtype and in 16 bits), the default counts every token in every layer."""
    model = build_family_model(family)
    full = DynamicCache(config=model.config)
    for seen in _passes(model, full, prompt, 12):
        assert full_cache_bytes(model, seen, windows=True) == _cache_bytes(full), seen
        assert full_cache_bytes(model, seen, element_size=2, windows=True) == _cache_bytes(full) // 2
    every_token = full_cache_bytes(model, seen)
    assert every_token >= _cache_bytes(full) and (every_token == _cache_bytes(full)) == (family == "llama")
