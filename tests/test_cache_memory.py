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
    first decoding step's token (the ``budget + 1`` slots the steps write into), one scratch slot (fp32 key and
    value, fp32 score and value norm, int32 position per slot), each segment's start and length (int64 each) and the
    row's padding (int64)."""
    model, tokenizer = fresh
    cache = CompressedCache(model, budget=40)
    ids = tokenizer([PROMPT], return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 40
    with torch.no_grad():
        model(ids, past_key_values=cache)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    kv_heads = config.num_key_value_heads
    per_slot = 2 * head_dim * 4 + 4 + 4 + 4
    # ... and the count of tokens seen, on the device for compiled steps (int64).
    expected = config.num_hidden_layers * ((kv_heads * 41 + 1) * per_slot + kv_heads * 8 + kv_heads * 8 + 8 + 8)
    assert cache.memory_bytes() == expected
    assert cache.memory_bytes() == bytes_by_hand(cache, model)
    for layer in cache.layers:
        assert torch.as_tensor(layer.storage.lengths_host).tolist() == [[40] * kv_heads]
        assert torch.as_tensor(layer.storage.capacities).tolist() == [[41] * kv_heads]


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
    assert all(len(layer.scorer.waiting) >= 2 for layer in cache.layers)  # the steps after the first eviction
    held = [tensor for layer in cache.layers for tensor in [*layer.storage.held_tensors(), layer.pads_device]]
    per_entry_and_padding = sum(storage_bytes(held).values())  # each storage once
    assert cache.memory_bytes() > per_entry_and_padding  # the queries (and their rotation) are held too
    assert cache.memory_bytes() == _bytes_reachable(cache)


def bytes_by_hand(cache: CompressedCache, model) -> int:
    """The bytes ``cache`` holds, counted by hand from the model's config and the cache's options, given each
    segment's capacity (``storage.capacities``), with no decoding step waiting to be scored and no prompt's queries
    kept for a refit. Per layer: a flat tensor per field of (every segment's capacity + one scratch slot) slots, each
    holding a key and a value (the model's dtype, 16 bits under ``kv_bits=16``, or codes and a 16-bit scale and
    offset per group), a position (int32), a score (float32), a value norm (float32, where eviction ranks by it:
    a uniform allocation with ``value_norm``) and a bias (float16, in the matched layers); each segment's start and
    length (int64), each row's padding (int64), the count of tokens seen where the size is fixed (int64, for compiled
    steps); for coded entries the residual window (16-bit keys and values per row
    and KV head, int32 positions); and, where keys are coded, one Hadamard matrix (float32) for the whole cache."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    options = cache.options
    stored = options.storage
    coded = {stored.kv_bits, stored.key_bits} & {8, 5, 4}
    sixteen = 2 if coded or stored.kv_bits == 16 else element  # an entry not coded: 16 bits, or the model's dtype
    part_bytes = []
    for bits in (stored.key_bits or stored.kv_bits, stored.kv_bits):
        if bits in (8, 5, 4):
            part_bytes.append(head_dim * bits // 8 + 2 * (head_dim // stored.group_size) * 2)
        else:
            part_bytes.append(head_dim * sixteen)
    value_norms = options.scoring.value_norm and options.size.allocation == "uniform"
    total = 0
    for index, layer in enumerate(cache.layers):
        assert len(layer.scorer.waiting) == 0 and layer.prompt_queries is None
        storage = layer.storage
        batch, heads = storage.batch, storage.heads
        per_slot = sum(part_bytes) + 4 + 4 + (4 if value_norms else 0)
        per_slot += 2 if index < options.scoring.matched_layers else 0
        slots = int(torch.as_tensor(storage.capacities).sum()) + 1
        total += slots * per_slot + batch * heads * 8 * 2 + batch * 8
        if layer.seen_device is not None:  # the count of tokens seen, on the device for compiled steps (int64)
            total += 8
        if coded:
            total += 2 * batch * heads * stored.residual_length * head_dim * 2 + stored.residual_length * 4
    if (stored.key_bits or stored.kv_bits) in (8, 5, 4):
        block = head_dim & -head_dim
        total += block * block * 4
    return total
