"""allocation="layers" (formerly "global"): one ranking of reconstruction scores shares a row's tokens among the
layers (every KV head of a layer keeping the layer's share); ``test_kv_heads.py`` tests "heads", the default."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit.cache import CompressedCache
from decodekit.cache.allocation import layer_counts
from decodekit.cache.size import full_cache_bytes, reserved_room
from decodekit.decoders import beam_search
from tests.test_cache_memory import bytes_by_hand
from tests.tiny import build_model

TEXT = (
    "The class statement creates a new class object. A function body runs when it is called, and its "
    "names are local. The pass key is 7311. Modules hold definitions; import binds them to a name. "
)


@pytest.fixture
def four_layers(tiny):
    _, tokenizer = tiny
    return build_model(tokenizer, num_layers=4), tokenizer


def _ids(tokenizer, text=TEXT * 3):
    return tokenizer([text], return_tensors="pt")["input_ids"]


def _naive_counts(priorities: list[torch.Tensor], target: int | list[int], floor: float) -> list[int]:
    """One row: every layer's j-th offer is the mean of its heads' j-th best scores; the first
    ceil(floor * target) offers of each layer come first (its own target, where each has one), then the best
    offers, the sum of the targets in all."""
    targets = target if isinstance(target, list) else [target] * len(priorities)
    offers = []
    for layer, priority in enumerate(priorities):
        ordered = [sorted(head.tolist(), reverse=True) for head in priority]
        for rank in range(len(ordered[0])):
            value = sum(head[rank] for head in ordered) / len(ordered)
            if value == -math.inf:
                continue
            forced = rank < math.ceil(floor * targets[layer])
            offers.append((forced, value, -layer, -rank, layer))
    offers.sort(reverse=True)
    counts = [0] * len(priorities)
    for *_, layer in offers[: sum(targets)]:
        counts[layer] += 1
    return counts


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("floor", [0.0, 0.2, 1.0])
def test_layer_counts_match_a_naive_ranking(seed, floor):
    generator = torch.Generator().manual_seed(seed)
    slots = [12, 9, 12]  # layers may hold different numbers of entries
    priorities = [torch.rand(2, 3, n, generator=generator) ** (layer + 1) for layer, n in enumerate(slots)]
    priorities[1][1, :, 7:] = -math.inf  # row 1 holds only 7 live entries in layer 1
    targets = torch.tensor([5, 4])
    counts = layer_counts(priorities, targets, floor)
    for row in range(2):
        expected = _naive_counts([p[row] for p in priorities], int(targets[row]), floor)
        assert counts[:, row].tolist() == expected
        assert int(counts[:, row].sum()) == 3 * int(targets[row])
        if floor == 1.0:
            assert counts[:, row].tolist() == [int(targets[row])] * 3


@pytest.mark.parametrize("floor", [0.0, 0.2, 1.0])
def test_a_windowed_layer_whose_scores_are_lowest_keeps_its_floor_of_its_own_window(floor):
    """Units with targets of their own (a sliding-window layer's even share is at most its window, 9 here, against
    the global layers' 30): the windowed unit, every score below the others', keeps exactly ``ceil(floor * 9)``
    (0, 2 and 9), not a floor of the global share, and the global layers take the rest; by a naive ranking."""
    generator = torch.Generator().manual_seed(5)
    global_scores = [torch.rand(1, 1, 40, generator=generator) + 1.0 for _ in range(2)]
    windowed = torch.rand(1, 1, 9, generator=generator)  # every score below the global layers'
    priorities = [global_scores[0], windowed, global_scores[1]]
    targets = torch.tensor([[30], [9], [30]])
    counts = layer_counts(priorities, targets, floor)[:, 0].tolist()
    assert counts == _naive_counts([p[0] for p in priorities], [30, 9, 30], floor)
    assert counts[1] == math.ceil(floor * 9) and sum(counts) == 69


def test_a_row_with_fewer_live_tokens_than_its_share_keeps_them_all():
    priorities = [torch.tensor([[[0.5, 0.4, -math.inf, -math.inf]]]), torch.tensor([[[0.3, 0.2, 0.1, 0.05]]])]
    assert layer_counts(priorities, torch.tensor([3]), 0.0).flatten().tolist() == [2, 4]


def _prefill(model, ids, **kwargs):
    kwargs = {"allocation": "layers", "replay": "forward", **kwargs}  # the replay pass, whatever the size
    cache = CompressedCache(model, scoring="reconstruction", reconstruction_chunk=16, **kwargs)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return cache


def test_layers_keep_their_share_of_one_budget_and_store_nothing_more(four_layers):
    model, tokenizer = four_layers
    ids = _ids(tokenizer)
    length = ids.shape[1]
    target = math.ceil(0.5 * length)
    cache = _prefill(model, ids, compression_ratio=0.5)
    kept = [layer.kept for layer in cache.layers]
    assert sum(kept) == 4 * target and len(set(kept)) > 1  # one budget, not the same in every layer
    assert min(kept) >= math.ceil(0.2 * target)
    room = reserved_room(cache.options.size.eviction_interval, grows=True)  # the steps' until the next eviction
    for layer, count in zip(cache.layers, kept, strict=True):
        heads = layer.storage.heads
        assert torch.as_tensor(layer.storage.lengths_host).tolist() == [[count] * heads]  # every head the same
        # The storage shrank to what the layer keeps and the room for the steps until the next eviction.
        assert torch.as_tensor(layer.storage.capacities).tolist() == [[count + room] * heads]
        positions = layer.positions()
        assert bool((positions >= 0).all()) and bool((positions < length).all())  # every slot holds a token
        assert all(len(set(head.tolist())) == count for head in positions[0])  # each once
    assert cache.kept_tokens == max(kept)
    uniform = _prefill(model, ids, compression_ratio=0.5, allocation="uniform")
    assert {layer.kept for layer in uniform.layers} == {target}
    # The same tokens in all, but the value norms the uniform cache ranks by (a float32 per entry and KV head) a
    # shared budget does not keep, and the first layer's refit biases (a float16 per entry and KV head): each
    # cache's bytes counted by hand.
    assert all("value_norms" not in layer.storage.fields for layer in cache.layers)
    assert all("value_norms" in layer.storage.fields for layer in uniform.layers)
    assert cache.memory_bytes() == bytes_by_hand(cache, model)
    assert uniform.memory_bytes() == bytes_by_hand(uniform, model)


def test_each_layer_keeps_its_best_scored_tokens(four_layers):
    """Oracle: the replay scores of a cache that evicts nothing, ranked by the naive allocation."""
    model, tokenizer = four_layers
    ids = _ids(tokenizer)
    full = _prefill(model, ids, compression_ratio=0.0)
    priorities, positions = [], []
    for layer in full.layers:
        assert layer.kept == ids.shape[1]  # nothing evicted: every slot holds a token
        priorities.append(layer.priority(layer.longest)[0])
        positions.append(layer.positions()[0].long())
    target = math.ceil(0.25 * ids.shape[1])
    counts = _naive_counts(priorities, target, 0.2)
    cache = _prefill(model, ids, compression_ratio=0.25 * 3)
    for layer, priority, position, count in zip(cache.layers, priorities, positions, counts, strict=True):
        assert layer.kept == count
        expected = position.gather(-1, priority.topk(count, dim=-1).indices).sort(dim=-1).values
        assert torch.equal(layer.kept_positions()[0].long(), expected)


def test_decoding_holds_each_layer_to_its_share_of_the_budget(four_layers):
    model, tokenizer = four_layers
    ids = _ids(tokenizer)
    cache = CompressedCache(model, budget=40, scoring="reconstruction", allocation="layers", eviction_interval=4)
    output = model.generate(ids, past_key_values=cache, do_sample=False, max_new_tokens=30, min_new_tokens=30,
                            pad_token_id=tokenizer.pad_token_id)  # thirty steps, whatever they pick  # fmt: skip
    assert output.shape[1] == ids.shape[1] + 30
    kept = [layer.kept for layer in cache.layers]
    counts = [int(layer.shares[0][0, 0]) for layer in cache.layers]
    assert all(int(layer.shares[1][0]) == 40 for layer in cache.layers)  # shares of an even share of 40
    assert sum(counts) == 4 * 40 and len(set(counts)) > 1
    for layer, count in zip(cache.layers, counts, strict=True):
        assert torch.as_tensor(layer.targets()).tolist() == [[count] * layer.storage.heads]
        assert layer.storage.capacity <= count + 1  # its share and the one slot the next token takes
        assert count - 3 <= layer.kept <= count  # between evictions, at most interval - 1 below
    assert sum(kept) <= 4 * 40


def test_rows_of_a_batch_get_their_own_allocation(four_layers):
    """Two prompts of the same length: batched, each decodes what it decodes alone."""
    model, tokenizer = four_layers
    first, second = _ids(tokenizer), _ids(tokenizer, (TEXT[60:] + TEXT[:60]) * 3)
    assert first.shape == second.shape
    alone = []
    for ids in (first, second):
        cache = CompressedCache(model, compression_ratio=0.6, scoring="reconstruction", allocation="layers")
        alone.append(model.generate(ids, past_key_values=cache, do_sample=False, max_new_tokens=12))
    cache = CompressedCache(model, compression_ratio=0.6, scoring="reconstruction", allocation="layers")
    together = model.generate(torch.cat([first, second]), past_key_values=cache, do_sample=False, max_new_tokens=12)
    assert torch.equal(together, torch.cat(alone))
    counts = torch.as_tensor(cache.layers[1].shares[0])
    assert not torch.equal(counts[0], counts[1])  # own shares


def test_beam_search_moves_each_rows_share_with_its_beams(four_layers):
    model, tokenizer = four_layers
    first, second = _ids(tokenizer), _ids(tokenizer, (TEXT[60:] + TEXT[:60]) * 3)
    kwargs = {"num_beams": 3, "max_new_tokens": 10, "custom_generate": beam_search, "do_sample": False}

    def make():
        return CompressedCache(model, budget=48, scoring="reconstruction", allocation="layers")

    alone = [model.generate(ids, past_key_values=make(), **kwargs) for ids in (first, second)]
    together = model.generate(torch.cat([first, second]), past_key_values=make(), **kwargs)
    assert torch.equal(together, torch.cat(alone))


def test_crop_keeps_the_shares_and_the_counts(four_layers):
    model, tokenizer = four_layers
    ids = _ids(tokenizer)
    cache = _prefill(model, ids, compression_ratio=0.5)
    before = [(torch.as_tensor(layer.shares[0]).clone(), torch.as_tensor(layer.shares[1]).clone(),
               layer.kept_positions().clone()) for layer in cache.layers]  # fmt: skip
    with torch.no_grad():  # five decoding steps (a pass of several tokens would be a piece of context: shared again)
        for step in range(5):
            position = torch.tensor([[ids.shape[1] + step]])
            model(ids[:, step : step + 1], past_key_values=cache, position_ids=position)
    cache.crop(-5)
    assert cache.get_seq_length() == ids.shape[1]
    for layer, (counts, bases, positions) in zip(cache.layers, before, strict=True):
        assert torch.equal(torch.as_tensor(layer.shares[0]), counts)
        assert torch.equal(torch.as_tensor(layer.shares[1]), bases)
        # The counts: each segment's length is the number of tokens it holds, every one seen before the pass.
        held = layer.positions()
        assert torch.as_tensor(layer.storage.lengths_host).tolist() == (held >= 0).sum(dim=-1).tolist()
        assert bool((held < ids.shape[1]).all())
        for head in range(layer.storage.heads):
            kept = {position for position in layer.kept_positions()[0, head].tolist() if position >= 0}
            assert kept <= set(positions[0, head].tolist())


def test_a_memory_fraction_holds_with_a_global_allocation(four_layers):
    model, tokenizer = four_layers
    ids = _ids(tokenizer, TEXT * 6)
    for fraction in (0.5, 0.25):
        cache = _prefill(model, ids, memory_fraction=fraction)
        assert len({layer.kept for layer in cache.layers}) > 1
        assert cache.memory_bytes() <= fraction * full_cache_bytes(model, ids.shape[1], element_size=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"allocation": "layer"}, r"allocation must be one of 'uniform', 'layers', 'heads'; got 'layer'"),
        ({"allocation": "layers"}, r"allocation='layers' needs scoring='reconstruction'"),
        ({"allocation": "global"}, r"allocation='layers' needs scoring='reconstruction'"),  # the earlier spelling
        ({"allocation": "layers", "scoring": "attention+novelty"}, r"allocation='layers' needs scoring="),
    ],
)
def test_bad_allocations_are_named(four_layers, kwargs, message):
    model, _ = four_layers
    with pytest.raises(ValueError, match=message):
        CompressedCache(model, compression_ratio=0.5, **kwargs)


def test_the_earlier_spelling_global_is_layers(four_layers):
    model, _ = four_layers
    cache = CompressedCache(model, compression_ratio=0.5, scoring="reconstruction", allocation="global")
    assert cache.options.size.allocation == "layers"


def test_the_kv_scoring_field_builds_a_reconstruction_cache_whose_heads_share_the_budget(four_layers):
    from decodekit import Strategy

    model, _ = four_layers
    cache = Strategy(kv_compression_ratio=0.5, kv_scoring="reconstruction").plan(model).cache
    assert (cache.options.scoring.method, cache.options.size.allocation) == ("reconstruction", "heads")
    assert Strategy(kv_budget=64).plan(model).cache.options.size.allocation == "uniform"
    with pytest.raises(ValueError, match="kv_scoring applies to a compressed cache"):
        Strategy(kv_scoring="reconstruction")
    with pytest.raises(ValueError, match="kv_scoring must be one of attention, reconstruction, attention"):
        Strategy(kv_budget=64, kv_scoring="kvzip")
