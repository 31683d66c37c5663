"""The attention each cached key receives, exactly, at flash-attention cost: two Triton kernels.

A key's score is the softmax probability every observed query gives it, summed over those queries
and over the query heads that share its KV head. Summing the columns of the attention matrix would
hold ``queries x keys`` logits; instead:

1. ``_row_log_sum_exp``: per query, the log-sum-exp of its logits over the keys it sees, computed
   block by block with a running maximum, as flash attention does (without the values);
2. ``_column_sums``: per block of keys, a loop over the blocks of queries that see them, adding
   ``exp(logit - lse)``: each query's probability of each key (the roles of queries and keys
   swapped, as in flash attention's backward pass for the keys).

Each program holds one ``[BLOCK_M, BLOCK_N]`` tile of logits; memory beyond the inputs is one float
per query and per key. Logits are accumulated in float32 (fp32 inputs multiply in full precision,
not TF32). Only the common case runs here: the observed queries are the pass's last ``window``
tokens, appended after every stored key, every stored entry live, causal visibility, no logit cap.
``CompressedLayer`` sends anything else (padding, dead slots, sliding windows, soft caps,
reconstruction replay) to its blocked PyTorch path. Importing this module needs Triton.

Example (on a CUDA machine)::

    queries = torch.randn(1, 8, 300, 64, device="cuda")  # [batch, heads, window, head_dim]
    keys = torch.randn(1, 2, 300, 64, device="cuda")  # [batch, kv_heads, slots, head_dim]
    received = attention_received(queries, keys, scaling=0.125)  # [1, 2, 300]: column sums per KV head
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

LOG2_E = math.log2(math.e)


class Tiling(NamedTuple):
    """How a kernel is cut: queries and keys per tile, warps per program, pipeline stages."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


ROW_TILING = Tiling(num_stages=3)  # _row_log_sum_exp: one program per block of queries
COLUMN_TILING = Tiling(num_stages=3)  # _column_sums: one program per block of keys


@triton.jit
def add_to_log_sum_exp(running_max, total, logits):
    """One tile of logits ``[BLOCK_M, BLOCK_N]`` (log2 scale) added to each row's running maximum and its sum of
    ``2 ** (logit - maximum)``, as flash attention does; returns both, updated."""
    new_max = tl.maximum(running_max, tl.max(logits, 1))
    total = total * tl.exp2(running_max - new_max) + tl.sum(tl.exp2(logits - new_max[:, None]), 1)
    return new_max, total


@triton.jit
def row_queries(queries, block, row_head, heads, group, rows_in_all, q_batch, q_head, q_row,
                HEAD_DIM: tl.constexpr, DIM: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """A row program's tile: its row, query head and KV head, its query rows, the head dimensions, which of them
    are real, and the ``[BLOCK_M, DIM]`` queries themselves (zeros past ``rows_in_all`` and ``HEAD_DIM``)."""
    batch, head = row_head // heads, row_head % heads
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DIM)
    in_dims = dims[None, :] < HEAD_DIM
    query_tile = queries + batch * q_batch + head * q_head + rows[:, None] * q_row + dims[None, :]
    query = tl.load(query_tile, mask=(rows[:, None] < rows_in_all) & in_dims, other=0.0)
    return batch, head // group, rows, dims, in_dims, query


@triton.jit
def column_keys(keys, block, row_head, heads, group, slots, k_batch, k_head, k_row,
                HEAD_DIM: tl.constexpr, DIM: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """A column program's tile: its row and KV head, its key slots, the head dimensions, which of them are real,
    and the ``[BLOCK_N, DIM]`` keys themselves (zeros past ``slots`` and ``HEAD_DIM``)."""
    kv_heads = heads // group
    batch, kv_head = row_head // kv_heads, row_head % kv_heads
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, DIM)
    in_dims = dims[None, :] < HEAD_DIM
    key_tile = keys + batch * k_batch + kv_head * k_head + cols[:, None] * k_row + dims[None, :]
    key = tl.load(key_tile, mask=(cols[:, None] < slots) & in_dims, other=0.0)
    return batch, kv_head, cols, dims, in_dims, key


@triton.jit
def key_tile_logits(query, key_base, cols, limit, k_row, dims, in_dims, qk_scale):
    """The ``[BLOCK_M, BLOCK_N]`` logits (times ``qk_scale``) of a row program's ``query`` tile against the keys of
    slots ``cols`` read from ``key_base`` (zeros at and past ``limit``: the caller hides what its queries do not
    see)."""
    key = tl.load(key_base + cols[:, None] * k_row + dims[None, :], mask=(cols[:, None] < limit) & in_dims, other=0.0)
    return tl.dot(query, tl.trans(key), input_precision="ieee") * qk_scale


@triton.jit
def tile_probabilities(query_base, lse_base, rows, row_count, q_row, dims, in_dims, key, qk_scale):
    """Each of the query ``rows``' probability of each key of a column program's tile (their ``2 ** (logit -
    lse)``), ``[BLOCK_M, BLOCK_N]``, and which rows are real (below ``row_count``; the others' probabilities are 0)."""
    in_rows = rows < row_count
    query = tl.load(query_base + rows[:, None] * q_row + dims[None, :], mask=in_rows[:, None] & in_dims, other=0.0)
    row_lse = tl.load(lse_base + rows, mask=in_rows, other=float("inf"))
    logits = tl.dot(query, tl.trans(key), input_precision="ieee") * qk_scale
    return tl.exp2(logits - row_lse[:, None]), in_rows


@triton.jit
def _row_log_sum_exp(
    queries, keys, lse,
    q_batch, q_head, q_row, k_batch, k_head, k_row,
    heads, group, window, first_slot, qk_scale,
    HEAD_DIM: tl.constexpr, DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """lse[b, h, i] = log2 of the sum over the keys query i sees of 2 ** (logit * qk_scale)."""
    block, row_head = tl.program_id(0), tl.program_id(1)
    batch, kv_head, rows, dims, in_dims, query = row_queries(
        queries, block, row_head, heads, group, window, q_batch, q_head, q_row, HEAD_DIM, DIM, BLOCK_M
    )
    key_base = keys + batch * k_batch + kv_head * k_head
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    visible = first_slot + tl.minimum((block + 1) * BLOCK_M, window)  # keys the block's last query sees
    for start in range(0, visible, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        logits = key_tile_logits(query, key_base, cols, visible, k_row, dims, in_dims, qk_scale)
        logits = tl.where(cols[None, :] <= first_slot + rows[:, None], logits, float("-inf"))
        running_max, total = add_to_log_sum_exp(running_max, total, logits)
    tl.store(lse + row_head * window + rows, running_max + tl.log2(total), mask=rows < window)


@triton.jit
def _column_sums(
    queries, keys, lse, received,
    q_batch, q_head, q_row, k_batch, k_head, k_row,
    heads, group, window, first_slot, slots, qk_scale,
    HEAD_DIM: tl.constexpr, DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """received[b, kv_head, j] = sum over the group's heads and the queries that see key j of its probability."""
    block, row_head = tl.program_id(0), tl.program_id(1)
    batch, kv_head, cols, dims, in_dims, key = column_keys(
        keys, block, row_head, heads, group, slots, k_batch, k_head, k_row, HEAD_DIM, DIM, BLOCK_N
    )
    total = tl.zeros([BLOCK_N], tl.float32)
    # The first query that sees any key of this block sits at block * BLOCK_N - first_slot.
    begin = (tl.maximum(block * BLOCK_N - first_slot, 0) // BLOCK_M) * BLOCK_M
    for member in range(group):
        head = kv_head * group + member
        query_base = queries + batch * q_batch + head * q_head
        lse_base = lse + (batch * heads + head) * window
        for start in range(begin, window, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            probabilities, in_rows = tile_probabilities(
                query_base, lse_base, rows, window, q_row, dims, in_dims, key, qk_scale
            )
            seen = (cols[None, :] <= first_slot + rows[:, None]) & in_rows[:, None]
            total += tl.sum(tl.where(seen, probabilities, 0.0), 0)
    tl.store(received + row_head * slots + cols, total, mask=cols < slots)


def attention_received(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    *,
    row_tiling: Tiling = ROW_TILING,
    column_tiling: Tiling = COLUMN_TILING,
) -> torch.Tensor:
    """Per row, KV head and key, the attention the observed queries pay it, summed over queries and group.

    ``queries`` ``[batch, heads, window, head_dim]`` are the last ``window`` of ``keys``' ``slots``
    positions (``[batch, kv_heads, slots, head_dim]``, same dtype), already rotated; query ``i`` sees
    keys ``0 .. slots - window + i``. Returns float32 ``[batch, kv_heads, slots]``. The tilings are
    for benchmarks that compare them.
    """
    batch, heads, window, head_dim = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    if not keys.is_cuda:  # Triton's interpreter (tests on a CPU) multiplies half-precision tiles wrongly
        queries, keys = queries.float(), keys.float()
    if queries.stride(-1) != 1:
        queries = queries.contiguous()
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    group, first_slot = heads // kv_heads, slots - window
    shape = {"HEAD_DIM": head_dim, "DIM": max(16, triton.next_power_of_2(head_dim))}
    qk_scale = scaling * LOG2_E
    strides = (*queries.stride()[:3], *keys.stride()[:3])
    lse = torch.empty((batch, heads, window), dtype=torch.float32, device=queries.device)
    rows = row_tiling
    _row_log_sum_exp[(triton.cdiv(window, rows.block_m), batch * heads)](
        queries, keys, lse, *strides, heads, group, window, first_slot, qk_scale, **shape,
        BLOCK_M=rows.block_m, BLOCK_N=rows.block_n, num_warps=rows.num_warps, num_stages=rows.num_stages,
    )  # fmt: skip
    received = torch.empty((batch, kv_heads, slots), dtype=torch.float32, device=queries.device)
    columns = column_tiling
    _column_sums[(triton.cdiv(slots, columns.block_n), batch * kv_heads)](
        queries, keys, lse, received, *strides, heads, group, window, first_slot, slots, qk_scale, **shape,
        BLOCK_M=columns.block_m, BLOCK_N=columns.block_n, num_warps=columns.num_warps,
        num_stages=columns.num_stages,
    )  # fmt: skip
    return received
