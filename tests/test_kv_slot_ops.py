"""The cache's slot operations against the PyTorch operators they replace: ``take_slots`` against ``gather``,
``best_in_slot_order`` against a top-k followed by a sort."""

from __future__ import annotations

import pytest
import torch

from decodekit.cache.scoring import PROTECTED, best_in_slot_order
from decodekit.cache.storage import slot_rows, take_slots


@pytest.mark.parametrize("trailing", [(), (5,), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool])
def test_take_slots_is_a_gather(trailing, dtype):
    generator = torch.Generator().manual_seed(0)
    tensor = (torch.randn(3, 2, 11, *trailing, generator=generator) * 4).to(dtype)
    index = torch.randint(0, 9, (3, 2, 6), generator=generator)
    along = index.view(*index.shape, *(1 for _ in trailing)).expand(*index.shape, *trailing)
    assert torch.equal(take_slots(tensor, index), tensor.gather(2, along))
    # From a view of the first 9 slots, and with the row numbers made for another tensor of 11 slots.
    assert torch.equal(take_slots(tensor[:, :, :9], index), tensor[:, :, :9].gather(2, along))
    assert torch.equal(take_slots(tensor, index, slot_rows(index, 11)), tensor.gather(2, along))


def test_take_slots_of_nothing():
    assert take_slots(torch.ones(2, 3, 4, 5), torch.zeros(2, 3, 0, dtype=torch.long)).shape == (2, 3, 0, 5)
    assert take_slots(torch.ones(2, 3, 0), torch.zeros(2, 3, 0, dtype=torch.long)).shape == (2, 3, 0)
    assert take_slots(torch.ones(0, 3, 4, 5), torch.zeros(0, 3, 2, dtype=torch.long)).shape == (0, 3, 2, 5)  # no rows


@pytest.mark.parametrize("keep", [0, 1, 7, 19, 20])
def test_best_in_slot_order_keeps_the_top_k_in_slot_order(keep):
    generator = torch.Generator().manual_seed(keep)
    priority = torch.randn(4, 3, 20, generator=generator)
    priority[..., :2] = PROTECTED  # protected sinks, tied
    priority[0, 0, 5:9] = -torch.inf  # dead slots
    priority[1, 1, 10:14] = 0.25  # a tie across the boundary
    index = best_in_slot_order(priority, keep)
    assert index.shape == (4, 3, keep)
    assert bool((index.diff(dim=-1) > 0).all())  # distinct, in slot order
    expected = priority.topk(keep, dim=-1).values
    assert torch.equal(priority.gather(-1, index).sort(dim=-1, descending=True).values, expected)
    untied = torch.randn(4, 3, 20, generator=generator)  # without ties, the very slots of a top-k
    assert torch.equal(best_in_slot_order(untied, keep), untied.topk(keep, dim=-1).indices.sort(dim=-1).values)
