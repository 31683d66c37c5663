"""Reconstruction scores without a replay pass: the prompt pass's own queries, placed where a replay would put them.

A replay of an ``L``-token prompt feeds token ``p`` again at position ``L + p``: its query sees every prompt entry
and, causally, the replay's own tokens of its chunk. The estimate takes the prompt pass's query of token ``p``
instead of the replay's (the same in a model's first layer, where a query depends on its token alone) and scores
what the replay would: rotary attention depends on positions only through their difference, so

- a prompt entry ``j`` is seen at distance ``L + p - j``: the query against the key moved ``L`` positions back;
- the replay's own token ``j`` (``j <= p``, in ``p``'s chunk) is seen at distance ``p - j``: the query against the
  prompt's key ``j`` as stored.

Each query's softmax runs over both parts; an entry's score is the most probability any query pays it.
"""

from __future__ import annotations

import math

import torch

from decodekit.cache.quantize import rotate as hadamard_rotate
from decodekit.cache.rotary import rotate

# Logits held at once: on a CPU a block that stays in the core's cache (4 MiB of float32; a 3072-token prompt's
# scores took 2.6 times as long with 128 MiB blocks, streamed through memory by each elementwise pass), on a GPU
# large blocks (128 MiB), so that few kernels are launched.
CPU_LOGIT_ELEMENTS, GPU_LOGIT_ELEMENTS = 1 << 20, 1 << 25


def rotation_past(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary turn by as many positions as a pass's embedding ``cos``, ``sin`` ``[batch, tokens >= 2, rotary]``
    covers (positions 0 to ``tokens - 1``), as float32 ``(cos, sin)`` ``[batch, rotary]``: the turn of the last
    position composed with the turn of position 1, made a plain rotation (without the attention scaling some rotary
    types fold into cos and sin). It is as exact as the embedding's own last position: 16-bit cos and sin stay
    within their rounding, where rotating by position 1 again and again would multiply its error.

    Example:
        >>> angles = torch.arange(7.0)[None, :, None] * torch.tensor([0.5, 0.1])  # positions 0..6, two frequencies
        >>> cos, sin = rotation_past(angles.cos(), angles.sin())
        >>> torch.allclose(cos, (7 * torch.tensor([[0.5, 0.1]])).cos(), atol=1e-6)
        True
    """
    cos64, sin64 = cos.double(), sin.double()
    last_cos, last_sin, one_cos, one_sin = cos64[:, -1], sin64[:, -1], cos64[:, 1], sin64[:, 1]
    turn_cos = last_cos * one_cos - last_sin * one_sin
    turn_sin = last_sin * one_cos + last_cos * one_sin
    length = torch.hypot(turn_cos, turn_sin)  # the scaling squared, and rounding
    return (turn_cos / length).float(), (turn_sin / length).float()


def moved_back(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: bool) -> torch.Tensor:
    """``keys`` ``[batch, heads, slots, head_dim]`` (float32, rotary already applied) moved back by the float32
    turn ``cos``, ``sin`` ``[batch, rotary]`` (``rotation_past``); ``rotated``: the keys are rotated by the Hadamard
    matrix, as a layer that reads its coded keys rotated holds them (the matrix is its own inverse)."""
    keys = hadamard_rotate(keys) if rotated else keys
    moved = rotate(keys, cos[:, None, None], -sin[:, None, None])
    return hadamard_rotate(moved) if rotated else moved


@torch.no_grad()
def replay_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    chunk: int,
    rotated: bool = False,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kernels: bool = False,
) -> torch.Tensor:
    """``[batch, kv_heads, slots]``: the most attention a replay of the prompt would pay each entry, estimated with
    the prompt pass's own rotated ``queries`` ``[batch, heads, tokens, head_dim]`` of every prompt token, over the
    prompt's ``keys`` ``[batch, kv_heads, tokens, head_dim]`` as attention reads them; ``cos``, ``sin``: the pass's
    rotary embedding ``[batch, tokens, rotary]``. ``chunk``: the prompt tokens a replay feeds per pass (a replayed
    token sees its own chunk's earlier tokens). ``kernels``: compute them with the Triton kernels of
    ``_triton_replay.py`` (one tile of logits at a time; not under a sliding window or a logit cap).

    Example:
        >>> queries, keys = torch.randn(1, 2, 6, 4), torch.randn(1, 1, 6, 4)
        >>> angles = torch.arange(6.0)[None, :, None] * torch.tensor([0.3, 0.05]).repeat(2)
        >>> replay_scores(queries, keys, 0.5, angles.cos(), angles.sin(), chunk=4).shape
        torch.Size([1, 1, 6])
    """
    batch, kv_heads, length, head_dim = keys.shape
    group = queries.shape[1] // kv_heads
    keys = keys.float()
    shift_cos, shift_sin = rotation_past(cos, sin)
    moved = moved_back(keys, shift_cos, shift_sin, rotated)
    if kernels and sliding_window is None and softcap is None:
        from decodekit.cache._triton_replay import replay_scores as with_kernels

        return with_kernels(queries, moved, keys, scaling, chunk)
    # Queries token-major, ``[batch, kv_heads, tokens, group, head_dim]``: a block of tokens is one matrix of
    # ``tokens * group`` rows against its KV head's keys (no copy of the keys per query head).
    grouped = (queries.float() * scaling).view(batch, kv_heads, group, length, head_dim).transpose(2, 3).contiguous()
    earlier = moved.transpose(-1, -2)  # [batch, kv_heads, head_dim, tokens] (a view: matmul reads it transposed)
    own = keys.transpose(-1, -2)
    received = grouped.new_zeros((batch, kv_heads, length))
    elements = CPU_LOGIT_ELEMENTS if keys.device.type == "cpu" else GPU_LOGIT_ELEMENTS
    block = max(1, min(chunk, elements // (batch * kv_heads * group * 2 * length)))
    for start, stop in _blocks(length, chunk, block):
        first_own = (start // chunk) * chunk
        queries_here = grouped[:, :, start:stop].flatten(2, 3)  # [batch, kv_heads, queries * group, head_dim]
        shape = (batch, kv_heads, stop - start, group, -1)
        prompt = torch.matmul(queries_here, earlier).view(shape)  # [batch, kv_heads, queries, group, length]
        replayed = torch.matmul(queries_here, own[..., first_own:stop]).view(shape)  # [..., stop - first_own]
        if softcap is not None:
            for logits in (prompt, replayed):
                logits.div_(softcap).tanh_().mul_(softcap)
        query_position = torch.arange(start, stop, device=keys.device)[:, None, None]
        own_position = torch.arange(first_own, stop, device=keys.device)
        hidden = own_position > query_position
        if sliding_window is not None:  # a window follows the cache's count, in which each chunk follows the prompt
            hidden |= query_position - own_position >= sliding_window
            prompt_position = torch.arange(length, device=keys.device)
            counted = length + query_position - first_own
            prompt.masked_fill_(counted - prompt_position >= sliding_window, -math.inf)
        replayed.masked_fill_(hidden, -math.inf)
        top = torch.maximum(prompt.amax(dim=-1, keepdim=True), replayed.amax(dim=-1, keepdim=True))
        prompt.sub_(top).exp_()
        total = prompt.sum(dim=-1, keepdim=True) + replayed.sub_(top).exp_().sum(dim=-1, keepdim=True)
        prompt.div_(total)
        torch.maximum(received, prompt.amax(dim=(2, 3)), out=received)
    return received


def _blocks(length: int, chunk: int, block: int):
    """``(start, stop)`` of the query blocks, none across a replay chunk's boundary."""
    for chunk_start in range(0, length, chunk):
        chunk_stop = min(chunk_start + chunk, length)
        for start in range(chunk_start, chunk_stop, block):
            yield start, min(start + block, chunk_stop)
