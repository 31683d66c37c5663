"""CompressedCache.memory_bytes() counts every byte the cache holds, checked against the storages themselves."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor

from decodekit.cache import CompressedCache
from decodekit.cache.storage import storage_bytes
from tests.tiny import build_model

PROMPT = " ".join(["The class statement creates a new class object and binds it to a name"] * 4)


@pytest.fixture
def fresh(tiny):
    _, tokenizer = tiny
    return build_model(tokenizer), tokenizer


def _every_tensor(value, seen_objects=None):
    """Every tensor reachable from ``value`` through attributes, dicts, lists and tuples (the oracle's walk)."""
    seen_objects = set() if seen_objects is None else seen_objects
    if id(value) in seen_objects:
        return
    seen_objects.add(id(value))
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _every_tensor(item, seen_objects)
    elif isinstance(value, list | tuple | set):
        for item in value:
            yield from _every_tensor(item, seen_objects)
    elif hasattr(value, "__dict__") and type(value).__module__.startswith("decodekit"):
        for name, item in vars(value).items():
            if name != "policy":
                yield from _every_tensor(item, seen_objects)


def _bytes_reachable(cache: CompressedCache) -> int:
    """The bytes of every distinct storage reachable from the cache's layers."""
    storages = {}
    for layer in cache.layers:
        for tensor in _every_tensor(layer):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


class _Check(LogitsProcessor):
    """After each step's forward pass: memory_bytes() against the reachable storages."""

    def __init__(self, cache):
        self.cache, self.compared = cache, []

    def __call__(self, input_ids, scores):
        self.compared.append((self.cache.memory_bytes(), _bytes_reachable(self.cache)))
        return scores


@pytest.mark.parametrize(
    ("prompts", "options"),
    [
        ([PROMPT], {"budget": 40, "eviction_interval": 8}),  # reserved room and waiting steps' queries
        ([PROMPT, "x = 1"], {"budget": 40, "eviction_interval": 8}),  # padding and dead slots
        ([PROMPT], {"compression_ratio": 0.5, "eviction_interval": 1}),
        ([PROMPT, "x = 1"], {"budget": 36, "eviction_interval": 3}),  # the floor
    ],
)
def test_memory_bytes_equals_every_storage_the_cache_can_reach(fresh, prompts, options):
    model, tokenizer = fresh
    cache = CompressedCache(model, recent_tokens=32, **options)
    check = _Check(cache)
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    model.generate(**batch, past_key_values=cache, max_new_tokens=30, do_sample=False,
                   pad_token_id=tokenizer.pad_token_id, logits_processor=[check])  # fmt: skip
    assert len(check.compared) == 30
    assert all(held == reachable for held, reachable in check.compared), check.compared
    assert cache.memory_bytes() == _bytes_reachable(cache)


def test_memory_bytes_after_prefill_is_the_hand_count(fresh):
    """Prompt alone over a budget of 40: per layer, 40 entries per KV head and the slot reserved after them for the
    first decoding step's token (the room of ``budget + 1`` the steps write into; fp32 key and value, fp32 score and
    value norm, int32 position, bool live flag), the row's padding (one int64) and the count of tokens seen that
    compiled decoding steps keep on the device (one int64)."""
    model, tokenizer = fresh
    cache = CompressedCache(model, budget=40)
    ids = tokenizer([PROMPT], return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 40
    with torch.no_grad():
        model(ids, past_key_values=cache)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_entry = 2 * head_dim * 4 + 4 + 4 + 4 + 1
    expected = config.num_hidden_layers * (config.num_key_value_heads * 41 * per_entry + 8 + 8)
    assert cache.memory_bytes() == expected
    assert [layer.slots for layer in cache.layers] == [40] * config.num_hidden_layers


def test_waiting_decoding_steps_are_counted(fresh):
    """Between evictions the steps' queries wait to be scored: the cache holds them, and says so."""
    model, tokenizer = fresh
    cache = CompressedCache(model, budget=40, eviction_interval=8)
    ids = tokenizer([PROMPT], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        model(ids, past_key_values=cache)
        for step in range(3):
            token = torch.tensor([[5 + step]])
            model(token, past_key_values=cache, position_ids=torch.tensor([[ids.shape[1] + step]]))
    assert all(len(layer._pending) >= 2 for layer in cache.layers)  # the steps after the first eviction
    per_entry_and_padding = sum(  # each storage once: the layers' reserved room is a slice of shared tensors
        storage_bytes(tensor for layer in cache.layers for tensor in [*layer._spare.values(), layer.pads]).values()
    )
    assert cache.memory_bytes() > per_entry_and_padding  # the queries (and their rotation) are held too
    assert cache.memory_bytes() == _bytes_reachable(cache)
