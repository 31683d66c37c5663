"""``waiting_attention`` (the waiting decoding steps scored at once) against a naive loop over steps and heads, in
one block and split into blocks of units (on a CPU each block's logits stay within ``CPU_WAITING_LOGIT_ELEMENTS``),
with one first slot for every segment or a first slot per segment (segments of different lengths)."""

from __future__ import annotations

import pytest
import torch

from decodekit.cache import received
from decodekit.cache.received import waiting_attention


def _naive(queries, keys, first, scaling, decay, biases) -> torch.Tensor:
    """One step, one leading index and one query head at a time: its softmax over the slots it saw, decayed and
    averaged over the query heads that share its KV head. ``first``: ``[..., kv_heads]``, each segment's first
    waiting slot; ``[..., kv_heads, slots]`` returned, 0 past what a segment's steps saw."""
    *lead, heads, steps, _ = queries.shape
    kv_heads, slots = keys.shape[-3], keys.shape[-2]
    group = heads // kv_heads
    expected = torch.zeros(*lead, kv_heads, slots)
    for index in torch.cartesian_prod(*(torch.arange(size) for size in lead)).view(-1, len(lead)).tolist():
        for step in range(steps):
            for head in range(heads):
                kv_head = (*index, head // group)
                visible = int(first[kv_head]) + step + 1
                logits = queries[(*index, head, step)] @ keys[kv_head][:visible].T * scaling
                if biases is not None:
                    logits = logits + biases[kv_head][:visible]
                expected[kv_head][:visible] += logits.softmax(dim=-1) * decay ** (steps - 1 - step) / group
    return expected


@pytest.mark.parametrize("limit", [1, 200, 1 << 18])  # every unit alone, blocks of uneven size, one block
@pytest.mark.parametrize("biased", [False, True])
def test_waiting_steps_scored_in_blocks_equal_a_naive_loop(monkeypatch, limit, biased):
    monkeypatch.setattr(received, "CPU_WAITING_LOGIT_ELEMENTS", limit)
    generator = torch.Generator().manual_seed(5)
    layers, rows, heads, kv_heads, steps, slots, head_dim = 3, 2, 4, 2, 3, 9, 8
    queries = torch.randn(layers, rows, heads, steps, head_dim, generator=generator)
    keys = torch.randn(layers, rows, kv_heads, slots + 2, head_dim, generator=generator)  # 2 slots past those seen
    biases = torch.randn(layers, rows, kv_heads, slots + 2, generator=generator) if biased else None
    first = slots - steps
    got = waiting_attention(queries, keys, first, scaling=0.35, decay=0.7, biases=biases)
    assert got.shape == (layers, rows, kv_heads, slots)
    firsts = torch.full((layers, rows, kv_heads), first)
    expected = _naive(queries, keys, firsts, 0.35, 0.7, biases)[..., :slots]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("limit", [1, 200, 1 << 18])
@pytest.mark.parametrize("biased", [False, True])
def test_waiting_steps_of_segments_of_different_lengths_equal_a_naive_loop(monkeypatch, limit, biased):
    """Each (row, KV head) segment's steps went after its own entries (``new_slots`` per segment): a step sees its
    segment's entries and the steps up to its own, nothing past them."""
    monkeypatch.setattr(received, "CPU_WAITING_LOGIT_ELEMENTS", limit)
    generator = torch.Generator().manual_seed(6)
    layers, rows, heads, kv_heads, steps, slots, head_dim = 3, 2, 4, 2, 3, 11, 8
    queries = torch.randn(layers, rows, heads, steps, head_dim, generator=generator)
    keys = torch.randn(layers, rows, kv_heads, slots, head_dim, generator=generator)
    biases = torch.randn(layers, rows, kv_heads, slots, generator=generator) if biased else None
    firsts = torch.randint(0, slots - steps + 1, (layers, rows, kv_heads), generator=generator)
    firsts[0, 0, 0], firsts[0, 0, 1] = 0, slots - steps  # the shortest and the longest segment
    got = waiting_attention(queries, keys, firsts, scaling=0.35, decay=0.7, biases=biases)
    assert got.shape == (layers, rows, kv_heads, slots)
    torch.testing.assert_close(got, _naive(queries, keys, firsts, 0.35, 0.7, biases), atol=1e-5, rtol=1e-5)
