"""allocation="heads": one ranking of reconstruction scores over every (layer, KV head), each head stored apart.

Oracles: the replay scores of a cache that evicts nothing, ranked by a naive loop (which tokens each
head keeps); a full-cache forward pass with a hand-made per-head mask (what attention over the heads
side by side computes); each prompt generated alone (batches and beams); the storage tensors' own
sizes (the bytes held).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from decodekit.cache import CompressedCache
from decodekit.cache.size import full_cache_bytes
from decodekit.cache.storage import storage_bytes
from decodekit.decoders import beam_search
from tests.test_kv_allocation import TEXT, _ids, _naive_counts
from tests.tiny import build_model

UNITS = 2 * 4  # KV heads times layers of the model below


@pytest.fixture
def four_layers(tiny):
    _, tokenizer = tiny
    return build_model(tokenizer, num_layers=4), tokenizer


def _prefill(model, ids, **kwargs):
    kwargs = {"replay": "forward", **kwargs}  # the replay pass, whatever the size (the oracles replay)
    cache = CompressedCache(model, scoring="reconstruction", allocation="heads", reconstruction_chunk=16, **kwargs)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return cache


def test_heads_keep_their_share_of_one_budget_and_store_nothing_more(four_layers):
    model, tokenizer = four_layers
    ids = _ids(tokenizer)
    target = math.ceil(0.5 * ids.shape[1])
    cache = _prefill(model, ids, compression_ratio=0.5)
    kept = [unit.kept for unit in cache.units]
    assert len(kept) == UNITS and sum(kept) == UNITS * target
    assert len(set(kept[0::2])) > 1 and any(a != b for a, b in zip(kept[0::2], kept[1::2], strict=True))
    assert min(kept) >= math.ceil(0.2 * target)  # the per-head floor
    for unit in cache.units:
        assert unit.keys.shape[1] == 1 and unit.slots == unit.kept  # one head, storing only what it keeps
        assert bool(unit.live.all())
    # Honest bytes: every storage behind the units' tensors, and the keys and values are what is kept.
    held = storage_bytes(tensor for unit in cache.units for tensor in unit.held_tensors())
    assert cache.memory_bytes() == sum(held.values())
    element = next(model.parameters()).element_size()
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert sum(unit.keys.numel() + unit.values.numel() for unit in cache.units) * element == (
        sum(kept) * 2 * head_dim * element
    )
    assert cache.kept_tokens == max(kept)


def test_each_head_keeps_its_best_scored_tokens(four_layers):
    """Oracle: the replay scores of a cache that evicts nothing, ranked over every head by a naive loop."""
    model, tokenizer = four_layers
    ids = _ids(tokenizer)
    full = _prefill(model, ids, compression_ratio=0.0)
    priorities = [unit._priority()[0] for unit in full.units]  # [1, slots] each: one head
    target = math.ceil(0.25 * ids.shape[1])
    counts = _naive_counts(priorities, target, 0.2)
    cache = _prefill(model, ids, compression_ratio=0.75)
    for unit, priority, count in zip(cache.units, priorities, counts, strict=True):
        assert unit.kept == count
        expected = priority.topk(count, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(unit.kept_positions()[0].long(), expected)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_attention_over_heads_of_different_lengths_equals_a_masked_full_forward(tiny, attention):
    """One layer, so that one mask serves the whole model: a full cache's forward pass with each query head
    seeing only its KV head's kept tokens gives the same logits as the compressed cache."""
    _, tokenizer = tiny
    model = build_model(tokenizer, num_layers=1)
    model.config._attn_implementation = attention
    ids = _ids(tokenizer)
    context, continuation = ids[:, :-6], ids[:, -6:]
    length = context.shape[1]
    cache = _prefill(model, context, compression_ratio=0.6, matched_layers=0)  # the kept entries as they were
    kept = [unit.kept_positions()[0, 0].long() for unit in cache.units]
    assert len({part.numel() for part in kept}) == 2  # the two heads keep different numbers
    positions = torch.arange(length, length + 6)[None]
    with torch.no_grad():
        ours = model(continuation, past_key_values=cache, position_ids=positions).logits
        full = DynamicCache()
        model(context, past_key_values=full)
        visible = torch.zeros(1, 4, 6, length + 6, dtype=torch.bool)
        for query_head in range(4):
            visible[0, query_head, :, kept[query_head // 2]] = True  # query heads 0-1 share KV head 0, 2-3 head 1
        visible[..., length:] = torch.ones(6, 6, dtype=torch.bool).tril()
        mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
        expected = model(continuation, past_key_values=full, position_ids=positions, attention_mask=mask).logits
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)


def test_decoding_holds_each_head_to_its_share_of_the_budget(four_layers):
    model, tokenizer = four_layers
    ids = _ids(tokenizer)
    cache = CompressedCache(model, budget=40, scoring="reconstruction", allocation="heads", eviction_interval=4)
    output = model.generate(ids, past_key_values=cache, do_sample=False, max_new_tokens=30,
                            pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    assert output.shape[1] == ids.shape[1] + 30
    counts = [int(unit.allocated[0, 0]) for unit in cache.units]
    assert sum(counts) == UNITS * 40 and len(set(counts)) > 1
    for unit, count in zip(cache.units, counts, strict=True):
        assert unit.slots <= count + 1  # its share and the one slot the next token takes
        assert count - 3 <= unit.kept <= count  # between evictions, at most interval - 1 below


@pytest.mark.parametrize(("interval", "kv_bits"), [(1, None), (8, None), (1, 4), (1, 5), (8, 8)])
def test_rows_of_a_batch_decode_what_each_decodes_alone(four_layers, interval, kv_bits):
    """Also with quantized entries, which a layer decodes for all its heads and rows at once."""
    model, tokenizer = four_layers
    first, second = _ids(tokenizer), _ids(tokenizer, (TEXT[60:] + TEXT[:60]) * 3)
    assert first.shape == second.shape

    def make():
        return CompressedCache(model, compression_ratio=0.6, scoring="reconstruction", allocation="heads",
                               eviction_interval=interval, kv_bits=kv_bits)  # fmt: skip

    alone = [model.generate(ids, past_key_values=make(), do_sample=False, max_new_tokens=12) for ids in (first, second)]
    cache = make()
    together = model.generate(torch.cat([first, second]), past_key_values=cache, do_sample=False, max_new_tokens=12)
    assert torch.equal(together, torch.cat(alone))
    assert not torch.equal(cache.units[1].allocated[0], cache.units[1].allocated[1])  # own shares


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_beam_search_moves_each_rows_shares_with_its_beams(four_layers, kv_bits):
    model, tokenizer = four_layers
    first, second = _ids(tokenizer), _ids(tokenizer, (TEXT[60:] + TEXT[:60]) * 3)
    kwargs = {"num_beams": 3, "max_new_tokens": 10, "custom_generate": beam_search, "do_sample": False}

    def make():
        return CompressedCache(model, budget=48, scoring="reconstruction", allocation="heads", kv_bits=kv_bits)

    alone = [model.generate(ids, past_key_values=make(), **kwargs) for ids in (first, second)]
    together = model.generate(torch.cat([first, second]), past_key_values=make(), **kwargs)
    assert torch.equal(together, torch.cat(alone))


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_crop_undoes_a_pass_over_heads_of_different_lengths(four_layers, kv_bits):
    model, tokenizer = four_layers
    ids = _ids(tokenizer)
    cache = _prefill(model, ids, compression_ratio=0.5, kv_bits=kv_bits)
    before = [(unit.kept_positions().clone(), unit.allocated.clone()) for unit in cache.units]
    with torch.no_grad():
        model(ids[:, :5], past_key_values=cache, position_ids=torch.arange(ids.shape[1], ids.shape[1] + 5)[None])
    cache.crop(-5)
    assert cache.get_seq_length() == ids.shape[1]
    for unit, (positions, allocated) in zip(cache.units, before, strict=True):
        assert torch.equal(unit.allocated, allocated)
        assert set(unit.kept_positions()[0, 0].tolist()) <= set(positions[0, 0].tolist())


@pytest.mark.parametrize("kv_bits", [None, 8, 5, 4])
def test_a_memory_fraction_holds_with_heads_of_their_own_lengths(four_layers, kv_bits):
    model, tokenizer = four_layers
    ids = _ids(tokenizer, TEXT * 6)
    widths = {"kv_bits": kv_bits} if kv_bits else {}
    for fraction in (0.5, 0.25):
        cache = _prefill(model, ids, memory_fraction=fraction, **widths)
        assert len({unit.kept for unit in cache.units}) > 1
        assert cache.memory_bytes() <= fraction * full_cache_bytes(model, ids.shape[1], element_size=2)
        cache = CompressedCache(model, memory_fraction=fraction, scoring="reconstruction", allocation="heads", **widths)
        output = model.generate(ids, past_key_values=cache, do_sample=False, max_new_tokens=6,
                                pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        assert output.shape[1] == ids.shape[1] + 6  # the last token's key is never stored
        assert cache.memory_bytes() <= fraction * full_cache_bytes(model, ids.shape[1] + 5, element_size=2)


def test_heads_need_reconstruction_scores(four_layers):
    model, _ = four_layers
    with pytest.raises(ValueError, match=r"allocation='heads' needs scoring='reconstruction'"):
        CompressedCache(model, compression_ratio=0.5, allocation="heads")
    with pytest.raises(ValueError, match=r"allocation must be one of 'uniform', 'global', 'heads'; got 'layer'"):
        CompressedCache(model, compression_ratio=0.5, scoring="reconstruction", allocation="layer")


def test_a_shared_budget_keeps_no_value_norms_and_sizes_its_entries_without_them(four_layers):
    model, tokenizer = four_layers
    cache = _prefill(model, _ids(tokenizer), compression_ratio=0.5)
    assert all(unit.value_norms is None and "_value_norms" not in unit.entries for unit in cache.units)
    sizes = {
        allocation: CompressedCache(model, memory_fraction=0.5, kv_bits=4, scoring="reconstruction",
                                    allocation=allocation).policy.entry_bytes.kept
        for allocation in ("uniform", "global", "heads")
    }  # fmt: skip
    assert sizes["global"] == sizes["heads"] == sizes["uniform"] - 4  # no float32 value norm per entry


@pytest.mark.parametrize("budget", [36, 37])  # the floor (sinks and recent tokens) and one above
def test_rows_at_the_floor_decode_what_each_decodes_alone(four_layers, budget):
    model, tokenizer = four_layers
    first, second = _ids(tokenizer), _ids(tokenizer, (TEXT[60:] + TEXT[:60]) * 3)

    def make():
        return CompressedCache(model, budget=budget, scoring="reconstruction", allocation="heads")

    alone = [model.generate(ids, past_key_values=make(), do_sample=False, max_new_tokens=12) for ids in (first, second)]
    cache = make()
    together = model.generate(torch.cat([first, second]), past_key_values=cache, do_sample=False, max_new_tokens=12)
    assert torch.equal(together, torch.cat(alone))
    assert all(unit.kept >= 36 for unit in cache.units)  # no head goes below the sinks and the recent window


@pytest.mark.parametrize("allocation", ["heads", "global", "uniform"])
def test_the_prompt_pass_is_scored_only_where_its_attention_counts(four_layers, monkeypatch, allocation):
    """Shared budgets rank by the replay alone, so the prompt's own pass is not scored (it cost as much as the
    replay's scoring); the oracle is the same cache made to score it anyway: the same kept tokens and scores."""
    from decodekit.cache.layer import CompressedLayer

    model, tokenizer = four_layers
    ids = _ids(tokenizer)
    scored = []
    received = CompressedLayer._attention_received

    def counted(self, *args, **kwargs):
        scored.append(self.replaying)
        return received(self, *args, **kwargs)

    def prefill(**kwargs):
        scored.clear()
        cache = CompressedCache(model, scoring="reconstruction", allocation=allocation, reconstruction_chunk=16,
                                compression_ratio=0.5, replay="forward", **kwargs)  # fmt: skip
        with torch.no_grad():
            model(ids, past_key_values=cache)
        return cache, list(scored)

    monkeypatch.setattr(CompressedLayer, "_attention_received", counted)
    cache, calls = prefill()
    assert calls and all(calls) == (allocation != "uniform")  # only replay passes were scored, or the prompt too
    monkeypatch.setattr(CompressedLayer, "awaits_replay_alone", property(lambda self: False))
    reference, calls = prefill()
    assert not all(calls)  # the reference scored the prompt's pass
    for unit, expected in zip(cache.units, reference.units, strict=True):
        assert torch.equal(unit.kept_positions(), expected.kept_positions())
        assert torch.equal(unit.scores, expected.scores)


def test_a_layer_codes_its_heads_entries_at_once_as_each_head_would(four_layers, monkeypatch):
    """After the prompt, a layer codes a pass's keys and values once for all its heads; the oracle is each head
    coding its own share (the cache before): the same entries stored and the same tokens decoded."""
    from decodekit.cache.layer import CompressedLayer

    model, tokenizer = four_layers
    ids = _ids(tokenizer)
    code = CompressedLayer._code
    calls = []

    def counted(self, key_states, value_states):
        calls.append(key_states.shape[1])
        return code(self, key_states, value_states)

    def decode():
        cache = CompressedCache(model, scoring="reconstruction", memory_fraction=0.25, reconstruction_chunk=16)
        with torch.no_grad():
            out = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
        return cache, out

    monkeypatch.setattr(CompressedLayer, "_code", counted)
    cache, tokens = decode()
    kv_heads = model.config.num_key_value_heads
    assert kv_heads in calls and set(calls) == {1, kv_heads}  # one unit's prompt; every head's later passes at once
    original_store = CompressedLayer.store
    monkeypatch.setattr(
        CompressedLayer, "store", lambda self, k, v, *, coded=None, read_keys=None: original_store(self, k, v)
    )
    calls.clear()
    reference, expected = decode()  # each unit codes its own share (the layer's coding is made and dropped)
    assert calls.count(1) > calls.count(kv_heads)
    assert torch.equal(tokens, expected)
    for unit, other in zip(cache.units, reference.units, strict=True):
        for name in ("keys", "values", "key_scales", "key_offsets", "value_scales", "value_offsets"):
            assert torch.equal(getattr(unit, name), getattr(other, name)), name


def test_a_layer_decodes_its_heads_at_once_as_each_head_would(four_layers, monkeypatch):
    """After the prompt, a quantized layer decodes every head's entries at once, into the side-by-side layout that
    attention reads, makes a step's mask and writes its exact entries for every head at once, and scores a step's
    token for every head at once where none waits; the oracle is each head masked, updated, decoded and scored
    apart, then padded side by side (the cache before): the same tokens, the same entries kept and the same
    scores."""
    from decodekit.cache.heads import HeadsLayer

    def begin_step_apart(self):  # each head's own mask, padded side by side
        masks = [unit.begin_pass(1) for unit in self.units]
        self._lengths = [unit.get_mask_sizes(1)[0] for unit in self.units]
        self._visible = self._layer_mask(1, masks)
        return self._visible

    model, tokenizer = four_layers
    ids = _ids(tokenizer)
    decoded_together = []
    together = HeadsLayer._decoded_side_by_side

    def counted(self):
        decoded_together.append(self)
        return together(self)

    scored_together = []
    score_together = HeadsLayer._score_step_together

    def counted_scoring(self, keys):
        done = score_together(self, keys)
        scored_together.append(done)
        return done

    def decode(sizes: dict):
        cache = CompressedCache(model, scoring="reconstruction", allocation="heads", reconstruction_chunk=16, **sizes)
        with torch.no_grad():
            out = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
        return cache, out

    sizes = [
        {"memory_fraction": 0.25},
        # With exact recent entries. (At a tenth of this tiny model's bytes, the first layer's refit biases, counted
        # for every token seen, leave each head at its floor: no heads of their own lengths.)
        {"memory_fraction": 0.12, "residual_length": 4},
        {"budget": 40, "kv_bits": 16, "key_bits": 4},  # keys coded, values stored as they are
    ]
    for size in sizes:
        monkeypatch.setattr(HeadsLayer, "_decoded_side_by_side", counted)
        monkeypatch.setattr(HeadsLayer, "_score_step_together", counted_scoring)
        decoded_together.clear()
        scored_together.clear()
        cache, tokens = decode(size)
        assert len(decoded_together) >= 12 * model.config.num_hidden_layers  # each decoding step, each layer
        if "memory_fraction" in size:  # a byte size evicts at every step: no step's scoring waits
            assert scored_together.count(True) >= 11 * model.config.num_hidden_layers
        assert any(len({unit.slots for unit in layer.units}) > 1 for layer in cache.layers)  # heads of own lengths
        monkeypatch.setattr(HeadsLayer, "update", HeadsLayer._update_apart)
        monkeypatch.setattr(HeadsLayer, "_begin_step", begin_step_apart)
        reference, expected = decode(size)
        monkeypatch.undo()
        assert torch.equal(tokens, expected)
        for layer, other in zip(cache.layers, reference.layers, strict=True):
            for unit, apart in zip(layer.units, other.units, strict=True):
                assert torch.equal(unit.positions, apart.positions)
                torch.testing.assert_close(unit.scores, apart.scores, rtol=1e-5, atol=1e-7)
