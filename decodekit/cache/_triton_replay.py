"""The replay estimate's scores (``replay_estimate.py``) at flash-attention cost: two Triton kernels.

Each prompt token's query sees every prompt key moved back by the prompt's length (``earlier``) and, causally,
the prompt's own keys of its replay chunk (``own``); an entry's score is the most probability any query of its KV
head's group pays its moved-back key. As in ``_triton_scoring.py``:

1. ``_replay_log_sum_exp``: per query, the log-sum-exp of its logits over both parts, block by block;
2. ``_replay_column_max``: per block of prompt keys, a loop over every query block, keeping the largest
   ``exp(logit - lse)``.

Each program holds one ``[BLOCK_M, BLOCK_N]`` tile of logits, accumulated in float32 (fp32 inputs multiply in full
precision). Only the common case runs here: no sliding window, no logit cap (``replay_scores`` keeps the others in
PyTorch). Importing this module needs Triton.

Example (on a CUDA machine)::

    queries = torch.randn(1, 8, 300, 64, device="cuda")  # [batch, heads, tokens, head_dim], rotated
    keys = torch.randn(1, 2, 300, 64, device="cuda")  # [batch, kv_heads, tokens, head_dim], as stored
    earlier = keys.clone()  # the same keys moved back by the prompt's length (replay_estimate.moved_back)
    scores = replay_scores(queries, earlier, keys, scaling=0.125, chunk=128)  # [1, 2, 300]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from decodekit.cache._triton_scoring import (
    COLUMN_TILING,
    LOG2_E,
    ROW_TILING,
    add_to_log_sum_exp,
    column_keys,
    key_tile_logits,
    row_queries,
    tile_probabilities,
)


@triton.jit
def _replay_log_sum_exp(
    queries, earlier, own, lse,
    q_batch, q_head, q_row, k_batch, k_head, k_row,
    heads, group, length, chunk, qk_scale,
    HEAD_DIM: tl.constexpr, DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """lse[b, h, i] = log2 of the sum of 2 ** (logit * qk_scale) over every moved-back key and over the own keys
    of query i's chunk up to i."""
    block, row_head = tl.program_id(0), tl.program_id(1)
    batch, kv_head, rows, dims, in_dims, query = row_queries(
        queries, block, row_head, heads, group, length, q_batch, q_head, q_row, HEAD_DIM, DIM, BLOCK_M
    )
    key_offset = batch * k_batch + kv_head * k_head
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, length, BLOCK_N):  # every prompt key, moved back: all visible
        cols = start + tl.arange(0, BLOCK_N)
        logits = key_tile_logits(query, earlier + key_offset, cols, length, k_row, dims, in_dims, qk_scale)
        logits = tl.where(cols[None, :] < length, logits, float("-inf"))
        running_max, total = add_to_log_sum_exp(running_max, total, logits)
    chunk_start = (rows // chunk) * chunk  # per query: the first own key it sees
    first = (block * BLOCK_M // chunk) * chunk
    last = tl.minimum((block + 1) * BLOCK_M, length)
    for start in range(first, last, BLOCK_N):  # the replayed tokens of each query's chunk, causally
        cols = start + tl.arange(0, BLOCK_N)
        logits = key_tile_logits(query, own + key_offset, cols, length, k_row, dims, in_dims, qk_scale)
        seen = (cols[None, :] <= rows[:, None]) & (cols[None, :] >= chunk_start[:, None])
        logits = tl.where(seen, logits, float("-inf"))
        running_max, total = add_to_log_sum_exp(running_max, total, logits)
    tl.store(lse + row_head * length + rows, running_max + tl.log2(total), mask=rows < length)


@triton.jit
def _replay_column_max(
    queries, earlier, lse, scores,
    q_batch, q_head, q_row, k_batch, k_head, k_row,
    heads, group, length, qk_scale,
    HEAD_DIM: tl.constexpr, DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """scores[b, kv_head, j] = the most probability any query of the group's heads pays moved-back key j."""
    block, row_head = tl.program_id(0), tl.program_id(1)
    batch, kv_head, cols, dims, in_dims, key = column_keys(
        earlier, block, row_head, heads, group, length, k_batch, k_head, k_row, HEAD_DIM, DIM, BLOCK_N
    )
    best = tl.zeros([BLOCK_N], tl.float32)
    for member in range(group):
        head = kv_head * group + member
        query_base = queries + batch * q_batch + head * q_head
        lse_base = lse + (batch * heads + head) * length
        for start in range(0, length, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            probabilities, in_rows = tile_probabilities(
                query_base, lse_base, rows, length, q_row, dims, in_dims, key, qk_scale
            )
            probabilities = tl.where(in_rows[:, None], probabilities, 0.0)
            best = tl.maximum(best, tl.max(probabilities, 0))
    tl.store(scores + row_head * length + cols, best, mask=cols < length)


def replay_scores(
    queries: torch.Tensor, earlier: torch.Tensor, own: torch.Tensor, scaling: float, chunk: int
) -> torch.Tensor:
    """``replay_estimate.replay_scores`` without a sliding window or a logit cap: ``queries`` ``[batch, heads,
    tokens, head_dim]`` rotated, ``earlier`` the prompt's keys moved back by its length and ``own`` the keys as
    stored (both ``[batch, kv_heads, tokens, head_dim]``, float32). Returns float32 ``[batch, kv_heads, tokens]``."""
    batch, heads, length, head_dim = queries.shape
    kv_heads = own.shape[1]
    queries, earlier, own = (part.float().contiguous() for part in (queries, earlier, own))
    group = heads // kv_heads
    shape = {"HEAD_DIM": head_dim, "DIM": max(16, triton.next_power_of_2(head_dim))}
    qk_scale = scaling * LOG2_E
    strides = (*queries.stride()[:3], *own.stride()[:3])
    lse = torch.empty((batch, heads, length), dtype=torch.float32, device=queries.device)
    rows = ROW_TILING
    _replay_log_sum_exp[(triton.cdiv(length, rows.block_m), batch * heads)](
        queries, earlier, own, lse, *strides, heads, group, length, chunk, qk_scale, **shape,
        BLOCK_M=rows.block_m, BLOCK_N=rows.block_n, num_warps=rows.num_warps, num_stages=rows.num_stages,
    )  # fmt: skip
    scores = torch.empty((batch, kv_heads, length), dtype=torch.float32, device=queries.device)
    columns = COLUMN_TILING
    _replay_column_max[(triton.cdiv(length, columns.block_n), batch * kv_heads)](
        queries, earlier, lse, scores, *strides, heads, group, length, qk_scale, **shape,
        BLOCK_M=columns.block_m, BLOCK_N=columns.block_n, num_warps=columns.num_warps,
        num_stages=columns.num_stages,
    )  # fmt: skip
    return scores
