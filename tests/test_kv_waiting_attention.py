"""``waiting_attention`` (the waiting decoding steps scored at once) against a naive loop over steps and heads, in
one block and split into blocks of units (on a CPU each block's logits stay within ``CPU_WAITING_LOGIT_ELEMENTS``)."""

from __future__ import annotations

import pytest
import torch

from decodekit.cache import scoring
from decodekit.cache.scoring import waiting_attention


def _naive(queries, keys, first, scaling, decay, biases) -> torch.Tensor:
    """One step, one leading index and one query head at a time: its softmax over the slots it saw, decayed and
    averaged over the query heads that share its KV head."""
    *lead, heads, steps, _ = queries.shape
    kv_heads = keys.shape[-3]
    group = heads // kv_heads
    expected = torch.zeros(*lead, kv_heads, first + steps)
    for index in torch.cartesian_prod(*(torch.arange(size) for size in lead)).view(-1, len(lead)).tolist():
        for step in range(steps):
            for head in range(heads):
                visible = first + step + 1
                kv_head = (*index, head // group)
                logits = queries[(*index, head, step)] @ keys[kv_head][:visible].T * scaling
                if biases is not None:
                    logits = logits + biases[kv_head][:visible]
                expected[kv_head][:visible] += logits.softmax(dim=-1) * decay ** (steps - 1 - step) / group
    return expected


@pytest.mark.parametrize("limit", [1, 200, 1 << 18])  # every unit alone, blocks of uneven size, one block
@pytest.mark.parametrize("biased", [False, True])
def test_waiting_steps_scored_in_blocks_equal_a_naive_loop(monkeypatch, limit, biased):
    monkeypatch.setattr(scoring, "CPU_WAITING_LOGIT_ELEMENTS", limit)
    generator = torch.Generator().manual_seed(5)
    layers, rows, heads, kv_heads, steps, slots, head_dim = 3, 2, 4, 2, 3, 9, 8
    queries = torch.randn(layers, rows, heads, steps, head_dim, generator=generator)
    keys = torch.randn(layers, rows, kv_heads, slots + 2, head_dim, generator=generator)  # 2 slots past those seen
    biases = torch.randn(layers, rows, kv_heads, slots + 2, generator=generator) if biased else None
    first = slots - steps
    got = waiting_attention(queries, keys, first=first, scaling=0.35, decay=0.7, biases=biases)
    assert got.shape == (layers, rows, kv_heads, slots)
    torch.testing.assert_close(got, _naive(queries, keys, first, 0.35, 0.7, biases), atol=1e-5, rtol=1e-5)
