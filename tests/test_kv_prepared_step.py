"""A decoding step into a prepared slot of plain entries (``CompressedLayer._update_prepared``, the storage's
``append_step``) against the step-by-step ``update`` it shortens: the same logits, the same entries, byte for byte.

Oracle: the same cache with the shortened path turned off, whose steps go through ``EntryStorage.append`` and
``read`` as before.
"""

from __future__ import annotations

import pytest
import torch

from decodekit.cache import CompressedCache
from decodekit.cache.layer import CompressedLayer
from decodekit.cache.storage import EntryStorage, Field
from tests.decode_steps import assert_same_entries, decode_by_hand, logits_of_greedy_steps, prompt_batch
from tests.families import VOCAB, build_family_model

CASES = {
    "the default (a budget, steps waiting to be scored)": ("llama", {"budget": 40}),
    "a share of the tokens, value norms ranked": ("qwen3", {"compression_ratio": 0.5, "eviction_interval": 4}),
    "a budget at its floor, the widest interval": ("llama", {"budget": 36, "eviction_interval": 64}),
}


def _decode(model, options: dict, steps: int) -> tuple[torch.Tensor, CompressedCache]:
    """Greedy steps by hand after a two-row prompt; the logits of every step, and the cache."""
    cache = CompressedCache(model, **options)
    prompt = torch.randint(3, VOCAB, (2, 70), generator=torch.Generator().manual_seed(2))
    return logits_of_greedy_steps(model, cache, prompt, steps), cache


@pytest.mark.parametrize("case", list(CASES))
def test_prepared_steps_give_the_step_by_step_logits_and_entries_byte_for_byte(monkeypatch, case):
    family, options = CASES[case]
    model = build_family_model(family)
    shortened = []
    original = CompressedLayer._update_prepared
    monkeypatch.setattr(CompressedLayer, "_update_prepared",
                        lambda self, *args: shortened.append(1) or original(self, *args))  # fmt: skip
    fast, fast_cache = _decode(model, options, steps=50)
    assert len(shortened) >= 50, "most steps of every layer should write a prepared slot"  # (2 layers x 50 steps)
    monkeypatch.setattr(CompressedLayer, "_writes_prepared_slot", lambda self, step: False)
    shortened.clear()
    slow, slow_cache = _decode(model, options, steps=50)
    assert not shortened
    assert torch.equal(fast, slow)
    assert_same_entries(fast_cache, slow_cache)
    assert [layer.seen for layer in fast_cache.layers] == [layer.seen for layer in slow_cache.layers]


def test_steps_that_do_more_take_the_step_by_step_path(monkeypatch):
    """Coded entries, entries stored in 16 bits for a float32 model (attention reads a copy), and an eviction
    interval of one (nothing waits to be scored) write no prepared slot; the default on the same model does."""
    shortened = []
    original = CompressedLayer._update_prepared
    monkeypatch.setattr(CompressedLayer, "_update_prepared",
                        lambda self, *args: shortened.append(1) or original(self, *args))  # fmt: skip
    model = build_family_model("llama")
    others = ({"budget": 40, "kv_bits": 4}, {"budget": 40, "kv_bits": 16}, {"budget": 40, "eviction_interval": 1})
    for options in others:
        _decode(model, options, steps=12)
        assert not shortened, options
    _decode(model, {"budget": 40}, steps=12)
    assert shortened


def test_append_step_refuses_segments_of_different_lengths():
    fields = {"keys": Field((2,), torch.float32), "values": Field((2,), torch.float32)}
    storage = EntryStorage(fields, batch=1, heads=2, capacity=4, device="cpu")
    storage.set_lengths(torch.tensor([[1, 2]]).numpy())
    with pytest.raises(ValueError, match="one length"):
        storage.append_step(torch.ones(1, 2, 1, 2), torch.ones(1, 2, 1, 2))
    storage.set_lengths(4)
    with pytest.raises(ValueError, match="have room"):
        storage.append_step(torch.ones(1, 2, 1, 2), torch.ones(1, 2, 1, 2))


def test_a_left_padded_batch_writes_prepared_slots_once_its_padding_is_dropped(monkeypatch, tiny):
    """Padding held in place has no prepared slots; after the first eviction drops it the steps write prepared
    slots, choosing the step-by-step path's tokens and holding its entries."""
    model, tokenizer = tiny
    batch = prompt_batch(tokenizer, padded=True)
    assert bool((batch["attention_mask"] == 0).any())
    shortened = []
    original = CompressedLayer._update_prepared
    monkeypatch.setattr(CompressedLayer, "_update_prepared",
                        lambda self, *args: shortened.append(1) or original(self, *args))  # fmt: skip
    fast_cache = CompressedCache(model, budget=40)
    fast = decode_by_hand(model, fast_cache, batch, steps=30)
    assert shortened
    monkeypatch.setattr(CompressedLayer, "_writes_prepared_slot", lambda self, step: False)
    slow_cache = CompressedCache(model, budget=40)
    slow = decode_by_hand(model, slow_cache, batch, steps=30)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(fast, slow, strict=True))
    assert_same_entries(fast_cache, slow_cache)
