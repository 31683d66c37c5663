"""allocation="heads": one ranking of reconstruction scores over every (layer, KV head), each KV head a segment of
its layer's storage with its own length.

Oracles: the replay scores of a cache that evicts nothing, ranked by a naive loop (which tokens each
head keeps); a full-cache forward pass with a hand-made per-head mask (what attention over the heads
side by side computes); each prompt generated alone (batches and beams); the bytes counted by hand;
each head's entries coded alone.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from decodekit.cache import CompressedCache
from decodekit.cache.coding import QuantizedCoding
from decodekit.cache.quantize import rotate as hadamard_rotate
from decodekit.cache.size import full_cache_bytes, reserved_room
from decodekit.cache.storage import storage_bytes
from decodekit.decoders import beam_search
from tests.test_cache_memory import bytes_by_hand
from tests.test_kv_allocation import TEXT, _ids, _naive_counts
from tests.tiny import build_model

UNITS = 2 * 4  # KV heads times layers of the model below


@pytest.fixture
def four_layers(tiny):
    _, tokenizer = tiny
    return build_model(tokenizer, num_layers=4), tokenizer


def _counts(cache) -> list[int]:
    """Per (layer, KV head), in that order: the tokens the first row keeps."""
    return [int(count) for layer in cache.layers for count in torch.as_tensor(layer.storage.lengths_host)[0]]


def _head_positions(layer, head: int) -> torch.Tensor:
    """The positions the first row's KV head ``head`` keeps, increasing."""
    positions = layer.kept_positions()[0, head].long()
    return positions[positions >= 0]


def _decode_steps(model, cache, ids, count: int) -> None:
    """``count`` decoding steps after ``ids``' prompt, each feeding the next of its tokens."""
    with torch.no_grad():
        for step in range(count):
            model(ids[:, step : step + 1], past_key_values=cache, position_ids=torch.tensor([[ids.shape[1] + step]]))


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
    kept = _counts(cache)
    assert len(kept) == UNITS and sum(kept) == UNITS * target
    assert len(set(kept[0::2])) > 1 and any(a != b for a, b in zip(kept[0::2], kept[1::2], strict=True))
    assert min(kept) >= math.ceil(0.2 * target)  # the per-head floor
    room = reserved_room(cache.options.size.eviction_interval, grows=True)  # the steps until the next eviction
    for layer in cache.layers:
        lengths = torch.as_tensor(layer.storage.lengths_host)
        # Each head stores only what it keeps and the room for the steps until the next eviction.
        assert torch.equal(torch.as_tensor(layer.storage.capacities), lengths + room)
        positions = layer.positions()
        assert torch.equal((positions >= 0).sum(dim=-1), lengths)  # every slot below a head's length holds a token
        for head in range(layer.storage.heads):
            assert len(set(positions[0, head, : int(lengths[0, head])].tolist())) == int(lengths[0, head])
    # Honest bytes: every storage behind the layers' tensors, and the bytes counted by hand; the keys and values
    # are what is kept, the room and one scratch slot per layer.
    held = storage_bytes(tensor for layer in cache.layers for tensor in layer.held_tensors())
    assert cache.memory_bytes() == sum(held.values()) == bytes_by_hand(cache, model)
    element = next(model.parameters()).element_size()
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    layers = model.config.num_hidden_layers
    stored = sum(layer.storage.flat["keys"].numel() + layer.storage.flat["values"].numel() for layer in cache.layers)
    assert stored * element == (sum(kept) + UNITS * room + layers) * 2 * head_dim * element
    assert cache.kept_tokens == max(kept)


def test_each_head_keeps_its_best_scored_tokens(four_layers):
    """Oracle: the replay scores of a cache that evicts nothing, ranked over every head by a naive loop."""
    model, tokenizer = four_layers
    ids = _ids(tokenizer)
    full = _prefill(model, ids, compression_ratio=0.0)
    priorities, positions = [], []  # per (layer, KV head): [1, slots], one head
    for layer in full.layers:
        assert layer.kept == ids.shape[1]  # nothing evicted: every slot holds a token
        priority, position = layer.priority(layer.longest)[0], layer.positions()[0].long()
        for head in range(layer.storage.heads):
            priorities.append(priority[head : head + 1])
            positions.append(position[head : head + 1])
    target = math.ceil(0.25 * ids.shape[1])
    counts = _naive_counts(priorities, target, 0.2)
    cache = _prefill(model, ids, compression_ratio=0.75)
    assert _counts(cache) == counts
    heads = [(layer, head) for layer in cache.layers for head in range(layer.storage.heads)]
    for (layer, head), priority, position, count in zip(heads, priorities, positions, counts, strict=True):
        expected = position.gather(-1, priority.topk(count, dim=-1).indices).sort(dim=-1).values
        assert torch.equal(_head_positions(layer, head)[None], expected)


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
    (layer,) = cache.layers
    kept = [_head_positions(layer, head) for head in range(layer.storage.heads)]
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
    counts = [int(count) for layer in cache.layers for count in layer.shares[0][0]]
    assert all(int(layer.shares[1][0]) == 40 for layer in cache.layers)  # shares of an even share of 40
    assert sum(counts) == UNITS * 40 and len(set(counts)) > 1
    capacities = [int(slots) for layer in cache.layers for slots in torch.as_tensor(layer.storage.capacities)[0]]
    for capacity, kept, count in zip(capacities, _counts(cache), counts, strict=True):
        assert capacity <= count + 1  # its share and the one slot the next token takes
        assert count - 3 <= kept <= count  # between evictions, at most interval - 1 below


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
    counts = torch.as_tensor(cache.layers[0].shares[0])
    assert not torch.equal(counts[0], counts[1])  # own shares


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
    before = [([_head_positions(layer, head) for head in range(layer.storage.heads)],
               torch.as_tensor(layer.shares[0]).clone()) for layer in cache.layers]  # fmt: skip
    assert any(len({part.numel() for part in positions}) > 1 for positions, _ in before)  # heads of own lengths
    _decode_steps(model, cache, ids, 5)  # (a pass of several tokens would be a piece of context: shared again)
    cache.crop(-5)
    assert cache.get_seq_length() == ids.shape[1]
    for layer, (positions, allocated) in zip(cache.layers, before, strict=True):
        assert torch.equal(torch.as_tensor(layer.shares[0]), allocated)
        for head, kept in enumerate(positions):
            assert set(_head_positions(layer, head).tolist()) <= set(kept.tolist())


@pytest.mark.parametrize("kv_bits", [None, 8, 5, 4])
def test_a_memory_fraction_holds_with_heads_of_their_own_lengths(four_layers, kv_bits):
    model, tokenizer = four_layers
    ids = _ids(tokenizer, TEXT * 6)
    widths = {"kv_bits": kv_bits} if kv_bits else {}
    for fraction in (0.5, 0.25):
        cache = _prefill(model, ids, memory_fraction=fraction, **widths)
        assert len(set(_counts(cache))) > 1
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
    with pytest.raises(ValueError, match=r"allocation must be one of 'uniform', 'layers', 'heads'; got 'layer'"):
        CompressedCache(model, compression_ratio=0.5, scoring="reconstruction", allocation="layer")


def test_a_shared_budget_keeps_no_value_norms_and_sizes_its_entries_without_them(four_layers):
    model, tokenizer = four_layers
    cache = _prefill(model, _ids(tokenizer), compression_ratio=0.5)
    assert all("value_norms" not in layer.storage.fields for layer in cache.layers)
    sizes = {
        allocation: CompressedCache(model, memory_fraction=0.5, kv_bits=4, scoring="reconstruction",
                                    allocation=allocation).policy.entry_bytes.kept
        for allocation in ("uniform", "layers", "heads")
    }  # fmt: skip
    assert sizes["layers"] == sizes["heads"] == sizes["uniform"] - 4  # no float32 value norm per entry


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
    for layer in cache.layers:  # no head goes below the sinks and the recent window
        assert bool((torch.as_tensor(layer.storage.lengths_host) >= 36).all())


@pytest.mark.parametrize("allocation", ["heads", "layers", "uniform"])
def test_the_prompt_pass_is_scored_only_where_its_attention_counts(four_layers, monkeypatch, allocation):
    """Shared budgets rank by the replay alone, so the prompt's own pass is not scored (it cost as much as the
    replay's scoring); the oracle is the same cache made to score it anyway: the same kept tokens and scores."""
    from decodekit.cache.scorers.attention import AttentionScorer
    from decodekit.cache.scorers.reconstruction import ReconstructionScorer

    model, tokenizer = four_layers
    ids = _ids(tokenizer)
    scored = []
    received, replayed = AttentionScorer.received, ReconstructionScorer.score_replay

    def counted(self, *args, **kwargs):
        scored.append(self.replaying)
        return received(self, *args, **kwargs)

    def counted_replay(self, *args, **kwargs):
        scored.append(self.replaying)
        return replayed(self, *args, **kwargs)

    def prefill(**kwargs):
        scored.clear()
        cache = CompressedCache(model, scoring="reconstruction", allocation=allocation, reconstruction_chunk=16,
                                compression_ratio=0.5, replay="forward", **kwargs)  # fmt: skip
        with torch.no_grad():
            model(ids, past_key_values=cache)
        return cache, list(scored)

    monkeypatch.setattr(AttentionScorer, "received", counted)
    monkeypatch.setattr(ReconstructionScorer, "score_replay", counted_replay)
    cache, calls = prefill()
    assert calls and all(calls) == (allocation != "uniform")  # only replay passes were scored, or the prompt too
    monkeypatch.setattr(ReconstructionScorer, "ranks_by_replay_alone", property(lambda self: False))
    reference, calls = prefill()
    assert not all(calls)  # the reference scored the prompt's pass
    for layer, expected in zip(cache.layers, reference.layers, strict=True):
        assert torch.equal(layer.kept_positions(), expected.kept_positions())
        assert torch.equal(layer.scores(), expected.scores())


@pytest.mark.parametrize(
    ("key_bits", "value_bits", "group_size"), [(4, 4, 16), (8, 4, 16), (5, 4, 8), (4, None, 16), (None, 8, 16)]
)
@pytest.mark.parametrize("rotated_reads", [False, True])
def test_a_layer_codes_its_heads_entries_at_once_as_each_head_would(key_bits, value_bits, group_size, rotated_reads):
    """A layer codes a pass's keys and values once for all its rows and heads; the oracle is each (row, KV head)
    coding its own entries alone: the same codes, scales and offsets, and the same keys as attention reads them."""
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 3, 7, 16, generator=generator)
    values = torch.randn(2, 3, 7, 16, generator=generator)

    def coding(first):
        made = QuantizedCoding(key_bits, value_bits, group_size, residual_length=4)
        made.rotated_reads = rotated_reads
        made.start(first)
        return made

    together, read_together = coding(keys).encode(keys, values)
    for row in range(2):
        for head in range(3):
            part = (slice(row, row + 1), slice(head, head + 1))
            alone, read_alone = coding(keys[part]).encode(keys[part], values[part])
            assert set(alone) == set(together)
            for name, coded in alone.items():
                assert torch.equal(together[name][part], coded), name
            assert torch.equal(read_together[part], read_alone)


@pytest.mark.parametrize(("kv_bits", "key_bits"), [(4, None), (8, None), (16, 4)])
def test_quantized_heads_of_different_lengths_read_what_a_masked_full_forward_reads(tiny, kv_bits, key_bits):
    """One layer, so that one mask serves the whole model: after decoding steps with heads of their own lengths, a
    step's logits equal a full forward pass over a DynamicCache holding each KV head's decoded entries side by side,
    each query head seeing only its KV head's entries (the layer decodes, masks and attends for every head at
    once, as each head apart would)."""
    _, tokenizer = tiny
    model = build_model(tokenizer, num_layers=1)
    ids = _ids(tokenizer)
    cache = CompressedCache(model, scoring="reconstruction", allocation="heads", reconstruction_chunk=16,
                            compression_ratio=0.6, kv_bits=kv_bits, key_bits=key_bits, residual_length=4,
                            eviction_interval=1, matched_layers=0)  # fmt: skip
    with torch.no_grad():
        model.generate(ids, past_key_values=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                       pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    (layer,) = cache.layers
    lengths = torch.as_tensor(layer.storage.lengths_host)[0]
    assert len(set(lengths.tolist())) == 2  # the two heads keep different numbers
    keys, values = (part.clone() for part in layer.decoded())
    seen, longest = cache.get_seq_length(), keys.shape[2]
    # The step's token enters the residual window and the oldest token it held leaves it: the step reads that one
    # as coded (decoded by a coding without a residual window).
    stored = cache.options.storage
    coded_only = QuantizedCoding(stored.key_bits or stored.kv_bits, stored.kv_bits if stored.kv_bits != 16 else None,
                                 stored.group_size, residual_length=0, smooth_keys=False)  # fmt: skip
    if layer.coding.smoothing:
        coded_only.set_key_means(layer.coding.key_means)
    coded_only.rotated_reads = layer.coding.rotated_reads
    coded_only.model_dtype, coded_only.stored_dtype = layer.coding.model_dtype, layer.coding.stored_dtype
    coded_keys, coded_values = coded_only.decode(layer.storage, longest)
    leaving = (layer.positions() == seen - stored.residual_length)[..., None]
    assert int(leaving.sum()) == 2  # in each head
    keys, values = torch.where(leaving, coded_keys, keys), torch.where(leaving, coded_values, values)
    if layer.coding.rotated_reads:  # keys read as coded, Hadamard-rotated (and queries alike): rotate them back
        keys = hadamard_rotate(keys.float()).to(keys.dtype)
    token, position = torch.tensor([[7]]), torch.tensor([[seen]])
    with torch.no_grad():
        ours = model(token, past_key_values=cache, position_ids=position).logits
        full = DynamicCache()
        full.update(keys, values, 0)
        visible = torch.zeros(1, 4, 1, longest + 1, dtype=torch.bool)
        for query_head in range(4):  # query heads 0-1 share KV head 0, 2-3 head 1
            visible[0, query_head, :, : int(lengths[query_head // 2])] = True
        visible[..., longest] = True  # the step's own token
        mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
        expected = model(token, past_key_values=full, position_ids=position, attention_mask=mask).logits
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)
