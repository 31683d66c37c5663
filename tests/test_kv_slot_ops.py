"""The cache's slot operations against the PyTorch operators and naive loops they replace: ``EntryStorage``'s reads
of its segments against ``gather`` on the dense entries, ``best_in_slot_order`` against a top-k followed by a sort,
``removal_moves`` against keeping the entries that are not victims."""

from __future__ import annotations

import pytest
import torch

from decodekit.cache.eviction import PROTECTED, best_in_slot_order, removal_moves
from decodekit.cache.storage import EntryStorage, Field


def _segmented(dense: torch.Tensor, generator: torch.Generator) -> EntryStorage:
    """A storage holding ``dense`` (``[batch, heads, slots, ...]``) whole in each segment, the segments of
    different capacities (a layout that is not rectangular)."""
    batch, heads, slots, *trailing = dense.shape
    storage = EntryStorage({"x": Field(tuple(trailing), dense.dtype)}, batch, heads, slots, "cpu")
    storage.append({"x": dense}, slots)
    capacities = slots + torch.randint(0, 4, (batch, heads), generator=generator)
    capacities[0, 0] = slots + 5
    storage.resize(capacities.numpy())
    assert not storage.rectangular
    return storage


@pytest.mark.parametrize("trailing", [(), (5,), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool])
def test_taking_slots_of_segments_is_a_gather(trailing, dtype):
    generator = torch.Generator().manual_seed(0)
    tensor = (torch.randn(3, 2, 11, *trailing, generator=generator) * 4).to(dtype)
    index = torch.randint(0, 9, (3, 2, 6), generator=generator)
    along = index.view(*index.shape, *(1 for _ in trailing)).expand(*index.shape, *trailing)
    storage = _segmented(tensor, generator)
    assert torch.equal(storage.take("x", index), tensor.gather(2, along))
    # Each segment's first 9 slots, and every slot a segment holds.
    assert torch.equal(storage.read("x", 9), tensor[:, :, :9])
    assert torch.equal(storage.read("x"), tensor)
    assert torch.as_tensor(storage.lengths_host).tolist() == [[11, 11]] * 3


def test_taking_no_slots():
    generator = torch.Generator().manual_seed(1)
    storage = _segmented(torch.ones(2, 3, 4, 5), generator)
    assert storage.take("x", torch.zeros(2, 3, 0, dtype=torch.long)).shape == (2, 3, 0, 5)
    assert storage.read("x", 0).shape == (2, 3, 0, 5)


@pytest.mark.parametrize("keep", [0, 1, 7, 19, 20])
def test_best_in_slot_order_keeps_the_top_k_in_slot_order(keep):
    generator = torch.Generator().manual_seed(keep)
    priority = torch.randn(4, 3, 20, generator=generator)
    priority[..., :2] = PROTECTED  # protected sinks, tied
    priority[0, 0, 5:9] = -torch.inf  # dead slots
    priority[1, 1, 10:14] = 0.25  # a tie across the boundary
    every = torch.ones(4, 3, 20, dtype=torch.bool)
    index = best_in_slot_order(priority, every, keep)
    assert index.shape == (4, 3, keep)
    assert bool((index.diff(dim=-1) > 0).all())  # distinct, in slot order
    expected = priority.topk(keep, dim=-1).values
    assert torch.equal(priority.gather(-1, index).sort(dim=-1, descending=True).values, expected)
    untied = torch.randn(4, 3, 20, generator=generator)  # without ties, the very slots of a top-k
    assert torch.equal(best_in_slot_order(untied, every, keep), untied.topk(keep, dim=-1).indices.sort(dim=-1).values)


@pytest.mark.parametrize("keep", [1, 7, 16])
def test_best_in_slot_order_of_segments_keeps_each_ones_top_k_of_its_entries(keep):
    """Segments of different lengths (the slots past a segment's length hold no entry) and of different counts: each
    keeps its own ``counts`` best entries, in slot order, never a slot past its length."""
    generator = torch.Generator().manual_seed(keep)
    priority = torch.randn(4, 3, 20, generator=generator)
    lengths = torch.randint(keep, 21, (4, 3), generator=generator)
    valid = torch.arange(20) < lengths[..., None]
    counts = torch.randint(0, keep + 1, (4, 3), generator=generator)
    counts[0, 0] = keep
    index = best_in_slot_order(priority, valid, keep, counts)
    assert index.shape == (4, 3, keep)
    for row in range(4):
        for head in range(3):
            count, length = int(counts[row, head]), int(lengths[row, head])
            expected = priority[row, head, :length].topk(count).indices.sort().values
            assert torch.equal(index[row, head, :count], expected)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("most_drops", [4, 1])
def test_removal_moves_leave_each_segment_its_entries_that_are_not_victims(seed, most_drops):
    """Oracle: per segment, the entries that stay, in any order, are its entries less its first ``drops`` victims;
    they fill its first ``length - drops`` slots, and at most ``n`` entries move (one victim at most included: an
    eviction at every step)."""
    generator = torch.Generator().manual_seed(seed)
    batch, heads, slots = 3, 2, 12
    lengths = torch.randint(4, slots + 1, (batch, heads), generator=generator)
    drops = torch.minimum(torch.randint(0, most_drops + 1, (batch, heads), generator=generator), lengths)
    most = int(drops.max())
    victims = torch.stack([
        torch.stack([torch.randperm(int(lengths[row, head]), generator=generator)[:most].sort().values
                     if int(lengths[row, head]) >= most else torch.arange(most) for head in range(heads)])
        for row in range(batch)
    ])  # fmt: skip
    entries = torch.arange(batch * heads * slots).view(batch, heads, slots)
    sources, targets, lanes = removal_moves(victims, lengths, drops)
    assert sources.shape == targets.shape == lanes.shape == (batch, heads, most)
    moved = entries.clone()
    for row, head, lane in lanes.nonzero().tolist():
        moved[row, head, targets[row, head, lane]] = entries[row, head, sources[row, head, lane]]
    for row in range(batch):
        for head in range(heads):
            length, drop = int(lengths[row, head]), int(drops[row, head])
            gone = set(victims[row, head, :drop].tolist())
            stays = {int(entries[row, head, slot]) for slot in range(length) if slot not in gone}
            assert sorted(moved[row, head, : length - drop].tolist()) == sorted(stays)
