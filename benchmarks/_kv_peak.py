"""kv_cache.py's section 5: the most bytes a cache holds at any moment through a whole ``generate``.

A compressed cache's layer holds the most right before it evicts, after its attention read a pass's tokens
(``CompressedLayer.end_pass``); each layer's ``end_pass`` is wrapped here to read ``memory_bytes()`` of the whole
cache at that moment. DynamicCache only grows, so its most is what it holds at the end. Figures are against a full
16-bit cache of the prompt and the new tokens (``full_cache_bytes``).
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from decodekit.cache import CompressedCache, full_cache_bytes

FRACTION = 0.25


def most_bytes_held(model, prompt: torch.Tensor, cache, new_tokens: int, chunk: int | None) -> tuple[int, float]:
    """The most bytes ``cache`` held at any moment while ``generate`` read ``prompt`` (in chunks of ``chunk``
    tokens, or one pass) and added ``new_tokens`` greedy tokens, and the seconds it took."""
    most = [0]
    if isinstance(cache, CompressedCache):
        for layer in cache.layers:
            evict = layer.end_pass

            def measured(query_length: int, evict=evict) -> None:
                most[0] = max(most[0], cache.memory_bytes())
                evict(query_length)

            layer.end_pass = measured
    chunking = {} if chunk is None else {"prefill_chunk_size": chunk}
    started = time.perf_counter()
    with torch.no_grad():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache, do_sample=False,
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens, **chunking)  # fmt: skip
    seconds = time.perf_counter() - started
    if isinstance(cache, CompressedCache):
        return max(most[0], cache.memory_bytes()), seconds
    tensors = [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]
    held = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    return held, seconds


def run(model, prompt: torch.Tensor, new_tokens: int, chunks: list[int], verdict) -> None:
    tokens = prompt.shape[1] + new_tokens
    full16 = full_cache_bytes(model, tokens, element_size=2)
    per_token = full_cache_bytes(model, 1, element_size=2)
    print(f"\n5. the most bytes held at any moment through generate ({prompt.shape[1]}-token prompt, {new_tokens} new "
          f"tokens), against a full 16-bit cache of {tokens} tokens ({full16 / 2**20:.2f} MiB)")  # fmt: skip
    rows = [("DynamicCache (the model's dtype)", DynamicCache(), None)]
    for scoring in ("attention", "reconstruction"):
        rows.append((f"memory_fraction={FRACTION}, {scoring}, one pass", None, None))
        rows += [(f"memory_fraction={FRACTION}, {scoring}, chunks of {chunk}", None, chunk) for chunk in chunks]
    for name, cache, chunk in rows:
        if cache is None:
            scoring = "reconstruction" if "reconstruction" in name else "attention"
            cache = CompressedCache(model, memory_fraction=FRACTION, scoring=scoring)
        held, seconds = most_bytes_held(model, prompt, cache, new_tokens, chunk)
        line = f"   {name:48s}{held / 2**20:8.2f} MiB {held / full16:6.3f}x full 16-bit  {seconds:7.1f} s"
        if chunk is not None:
            bound = FRACTION * full16 + chunk * per_token
            line += f"  (target <= {bound / full16:.3f}x: fraction + one chunk, {verdict(held <= bound)})"
        print(line)
