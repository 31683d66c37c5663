"""The attention stored entries receive from a pass's queries: what every scorer is built on.

A query's attention is a softmax over the entries it may see; an entry receives, per KV head, the probabilities of
the query heads that share it. ``attention_received`` sums them over the observed queries (or keeps the most any
query pays, for a replay) without holding more than a block of logits; ``waiting_attention`` scores decoding
steps that waited for the next eviction, as one step at a time would have.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache, lru_cache
from types import ModuleType

import torch

QUERY_BLOCK = 128  # observed queries scored at once
LOGIT_ELEMENTS = 1 << 25  # at most this many logits (128 MiB in float32) held at once while scoring
# Waiting steps scored on a CPU: at most this many logits at once (1 MiB in float32), so that a block's logits,
# probabilities and weighted sums stay in the processor's cache.
CPU_WAITING_LOGIT_ELEMENTS = 1 << 18


@cache
def triton_kernels() -> ModuleType | None:
    """The Triton scoring kernels, or None where Triton is not installed."""
    try:
        import decodekit.cache._triton_scoring as kernels
    except ImportError:
        return None
    return kernels


def uses_triton(backend: str, device: torch.device) -> bool:
    """Whether scores run on the Triton kernels: ``backend`` "auto" on CUDA with Triton installed, or "triton"
    (ValueError where it cannot run), never "torch"."""
    if backend == "torch":
        return False
    if backend == "auto":
        return device.type == "cuda" and triton_kernels() is not None
    if triton_kernels() is None:
        raise ValueError("scoring_backend='triton' needs the triton package (pip install triton)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"scoring_backend='triton' needs the cache on a CUDA device; it is on {device}: "
            "use scoring_backend='auto' or 'torch'"
        )
    return True


@dataclass
class Visibility:
    """Which entries a pass's observed queries may see.

    The queries sit at consecutive positions from ``first_query`` (a number, or a 0-d tensor in a compiled step).
    An entry is seen by a query at or after its position, when it is ``valid`` (a stored or new entry; None: all),
    and within a ``sliding_window``. A query before its row's ``pads`` (left padding) sees the invalid entries
    before it instead, so that it gives valid ones nothing. ``appended``: the queries are the last slots of every
    segment, in order, and every slot is valid (no padding, no window): causal visibility by slot.
    """

    positions: torch.Tensor  # [batch, kv_heads, slots], int
    first_query: int | torch.Tensor
    valid: torch.Tensor | None = None  # [batch, kv_heads, slots], bool
    pads: torch.Tensor | None = None  # [batch]
    sliding_window: int | None = None
    appended: bool = False

    def hidden(self, start: int, count: int, visible: int) -> torch.Tensor:
        """``[batch, kv_heads, 1, count, visible]``: True where query ``start + i`` may not see one of the first
        ``visible`` slots."""
        positions = self.positions[:, :, None, None, :visible]
        query = _consecutive(self.first_query, start, count, positions.device)[:, None]
        hidden = positions > query
        if self.valid is not None:
            invalid = ~self.valid[:, :, None, None, :visible]
            if self.pads is not None:
                invalid = invalid & (query >= self.pads[:, None, None, None, None])
            hidden = hidden | invalid
        if self.sliding_window is not None:
            hidden = hidden | (query - positions >= self.sliding_window)
        return hidden


def _consecutive(first: int | torch.Tensor, start: int, count: int, device: torch.device) -> torch.Tensor:
    if isinstance(first, torch.Tensor):
        return torch.arange(start, start + count, device=device) + first
    return torch.arange(first + start, first + start + count, device=device)


@torch.no_grad()
def attention_received(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    visibility: Visibility,
    *,
    softcap: float | None = None,
    biases: torch.Tensor | None = None,
    most: bool = False,
    weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    outside: torch.Tensor | None = None,
    kernels: bool = False,
) -> torch.Tensor:
    """``[batch, kv_heads, slots]`` float32: per entry, the attention the observed ``queries`` ``[batch, heads,
    window, head_dim]`` (rotated) pay it over ``keys`` ``[batch, kv_heads, slots, head_dim]`` (as attention reads
    them), summed over queries and the query heads that share a KV head; with ``most``, the most any query pays it.

    ``biases``: each entry's log-mass bias added to its logits; ``weights``: per query a weight ``[batch, window]``
    and per query head and entry ``[batch, kv_heads, group, 1, slots]``, multiplied into the probabilities before
    the maximum (KVzip+); ``outside``: ``[batch, kv_heads, 1, 1, slots]``, entries a replayed chunk does not score.
    ``kernels``: the Triton kernels, where they apply (appended, no cap, no bias, summed).

    Example:
        >>> keys, queries = torch.randn(1, 1, 3, 4), torch.randn(1, 2, 3, 4)
        >>> visibility = Visibility(torch.arange(3).view(1, 1, 3), first_query=0, appended=True)
        >>> received = attention_received(queries, keys, 0.5, visibility)
        >>> round(float(received.sum()), 4)  # every query's probabilities sum to one: 2 heads x 3 queries
        6.0
    """
    batch, kv_heads, slots, head_dim = keys.shape
    window, group = queries.shape[2], queries.shape[1] // kv_heads
    plain = softcap is None and biases is None and not most and outside is None
    if window == 1 and visibility.valid is None and visibility.sliding_window is None and plain:
        # One decoding step that sees every entry: logits in the cache's dtype, as eager attention computes them,
        # then a float32 softmax per query head.
        grouped = queries.to(keys.dtype).reshape(batch, kv_heads, group, head_dim)
        logits = torch.matmul(grouped, keys.transpose(-1, -2)).float().mul_(scaling)
        return logits.softmax(dim=-1).sum(dim=2)
    if kernels and visibility.appended and plain:
        return triton_kernels().attention_received(queries.to(keys.dtype), keys, scaling)
    # Queries token-major, ``[batch, kv_heads, window, group, head_dim]``: a block of queries is one matrix of
    # ``queries * group`` rows against its KV head's keys (no copy of the keys per query head).
    grouped = (queries.float() * scaling).view(batch, kv_heads, group, window, head_dim).transpose(2, 3).contiguous()
    keys_t = keys.float().transpose(-1, -2)  # [batch, kv_heads, head_dim, slots] (a view where keys are float32)
    first_slot = slots - window
    received = grouped.new_zeros((batch, kv_heads, slots))
    query_weights = output_norms = None
    if weights is not None:
        query_weights, output_norms = weights
        output_norms = output_norms.transpose(2, 3)  # [batch, kv_heads, 1, group, slots]
    block = max(1, min(QUERY_BLOCK, LOGIT_ELEMENTS // max(batch * kv_heads * group * slots, 1)))
    for start in range(0, window, block):
        stop = min(start + block, window)
        visible = first_slot + stop if visibility.appended else slots
        rows = grouped[:, :, start:stop].flatten(2, 3)  # [b, h, w * g, d]
        logits = torch.matmul(rows, keys_t[..., :visible]).view(batch, kv_heads, stop - start, group, visible)
        if softcap is not None:
            logits.div_(softcap).tanh_().mul_(softcap)
        if biases is not None:
            logits += biases[:, :, None, None, :visible].float()
        if visibility.appended:
            diagonal = logits[..., first_slot + start : visible]
            above = torch.full((stop - start, visible - first_slot - start), -math.inf, device=logits.device)
            diagonal += above.triu_(1)[:, None]  # [w, 1, t]: each query's later tokens
        else:
            logits.masked_fill_(visibility.hidden(start, stop - start, visible).transpose(2, 3), -math.inf)
        if outside is not None:
            logits.masked_fill_(outside[..., :visible], -math.inf)
        logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
        if most:  # the most attention any query pays each entry
            logits.div_(logits.sum(dim=-1, keepdim=True))
            if query_weights is not None:
                logits.mul_(query_weights[:, None, start:stop, None, None]).mul_(output_norms[..., :visible])
            received[..., :visible] = torch.maximum(received[..., :visible], logits.amax(dim=(2, 3)))
            continue
        # Normalize each query's row and sum over the queries in one product: (1 / row sums) @ exp.
        inverse = logits.sum(dim=-1).reciprocal_().reshape(batch, kv_heads, 1, -1)
        flat = logits.view(batch, kv_heads, -1, visible)
        received[..., :visible] += torch.matmul(inverse, flat).squeeze(2)
    return received


def per_query(
    received: torch.Tensor,
    positions: torch.Tensor,
    seen: int | torch.Tensor,
    window: int,
    group: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention summed over ``window`` observed queries and a KV head's ``group`` (``attention_received``) as a
    mean per query that sees each entry: the entries among the newest tokens are seen by fewer queries, and so,
    under a ``sliding_window``, are the entries that leave it. ``seen``: the tokens seen after the pass.

    Example:
        >>> per_query(torch.tensor([[[3.0, 2.0, 1.0]]]), torch.arange(3).view(1, 1, 3), seen=3, window=3, group=1)
        tensor([[[1., 1., 1.]]])
    """
    last_seer = seen
    if sliding_window is not None:
        last_seer = (positions + sliding_window).clamp(max=seen)
    seen_by = (last_seer - positions.clamp(min=seen - window)).clamp(min=1) * group
    return received / seen_by


def pooled(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """``scores`` ``[batch, kv_heads, slots]`` averaged over ``kernel`` neighbouring slots (odd; 1: unchanged)."""
    if kernel == 1:
        return scores
    batch, kv_heads, slots = scores.shape
    flat = scores.reshape(batch * kv_heads, 1, slots)
    smoothed = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    return smoothed.reshape(batch, kv_heads, slots)


@lru_cache(maxsize=64)
def _step_tensors(steps: int, group: int, decay: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For scoring ``steps`` waiting decoding steps at once: ``[steps, steps]``, True where step t may not see step
    u's token (u > t), and ``[1, group * steps]``, the weight of step t's attention (``decay ** (steps - 1 - t)``)
    over the ``group`` query heads that share a KV head. Built once per shape and device (read only)."""
    later = torch.ones(steps, steps, dtype=torch.bool, device=device).triu_(1)
    exponents = torch.arange(steps - 1, -1, -1, dtype=torch.float64, device=device)
    return later, (decay**exponents / group).to(torch.float32).repeat(group)[None, :]


def waiting_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    new_slots: torch.Tensor | int,
    scaling: float,
    decay: float,
    biases: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention ``steps`` waiting decoding steps paid, as one step at a time would have added it: ``[...,
    kv_heads, slots]`` from their rotated queries ``[..., heads, steps, head_dim]`` over the stored keys ``[...,
    kv_heads, slots, head_dim]``. Step ``t``'s token is in slot ``new_slots + t`` (one first slot for all, or a
    tensor ``[..., kv_heads]`` of each segment's), and it saw the slots before the steps' tokens and the steps' tokens
    up to its own; its attention is decayed ``steps - 1 - t`` times and averaged over the query heads that share a
    KV head. ``biases``: each entry's log-mass bias, added to its logits.

    Example:
        >>> queries, keys = torch.zeros(1, 2, 2, 4), torch.zeros(1, 1, 3, 4)  # 2 query heads, 1 KV head
        >>> waiting_attention(queries, keys, 1, scaling=1.0, decay=0.5)  # step 0 sees 2 slots, step 1 all 3
        tensor([[[0.5833, 0.5833, 0.3333]]])
    """
    *lead, heads, steps, head_dim = queries.shape
    kv_heads, slots = keys.shape[-3], keys.shape[-2]
    group = heads // kv_heads
    grouped = queries.to(keys.dtype).reshape(-1, group * steps, head_dim)
    keys = keys.reshape(-1, slots, head_dim)
    if biases is not None:
        biases = biases.reshape(-1, slots)
    step_tensors = _step_tensors.__wrapped__ if torch.compiler.is_compiling() else _step_tensors
    later, weights = step_tensors(steps, group, decay, keys.device)
    if isinstance(new_slots, int):
        keys = keys[:, : new_slots + steps]
        if biases is not None:
            biases = biases[:, : new_slots + steps]
        hidden = None
    else:  # [units, steps, slots]: True where step t may not see a slot (past its length, or a later step's token)
        first = new_slots.reshape(-1, 1, 1)
        slot = torch.arange(slots, device=keys.device)
        step = torch.arange(steps, device=keys.device)[:, None]
        hidden = slot > first + step
    limit = CPU_WAITING_LOGIT_ELEMENTS if keys.device.type == "cpu" else LOGIT_ELEMENTS
    units, visible = grouped.shape[0], keys.shape[1]
    block = max(limit // (group * steps * visible), 1)
    parts = []
    for start in range(0, units, block):
        part = slice(start, start + block)
        parts.append(_weighted_attention(
            grouped[part], keys[part], new_slots if hidden is None else None, scaling, later, weights,
            None if biases is None else biases[part], None if hidden is None else hidden[part],
        ))  # fmt: skip
    received = parts[0] if len(parts) == 1 else torch.cat(parts)
    return received.view(*lead, kv_heads, visible)


def _weighted_attention(grouped, keys, first, scaling, later, weights, biases, hidden) -> torch.Tensor:
    """``waiting_attention`` for units of queries ``[n, group * steps, head_dim]`` over keys ``[n, visible,
    head_dim]``: ``[n, visible]``."""
    steps = later.shape[0]
    logits = torch.matmul(grouped, keys.transpose(-1, -2)).float().mul_(scaling)
    if biases is not None:
        logits += biases[:, None, :].float()
    stepwise = logits.view(logits.shape[0], -1, steps, logits.shape[-1])  # [n, group, steps, visible]
    if hidden is None:
        stepwise[..., first:].masked_fill_(later, -math.inf)  # step t sees the steps' tokens up to its own
    else:
        stepwise.masked_fill_(hidden[:, None], -math.inf)
    # A weighted sum over the query rows, not a matmul: a broadcast matmul's rounding changes with ``n`` on some
    # CPUs, and a unit's scores must not depend on how many units are computed with it (``joint.py``).
    return (weights[..., None] * logits.softmax(dim=-1)).sum(dim=-2)
