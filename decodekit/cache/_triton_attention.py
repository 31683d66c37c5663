"""A decoding step's attention over coded entries, read where they lie: two Triton kernels.

1. ``_step_logits``: per (row, KV head, block of slots), each slot's key is decoded in registers from its codes, group
   scales and offsets (its row and head's mean key added where keys are smoothed), and each query head of the group
   gets its logit (scaled, capped, biased; -inf past the segment's stored entries and outside a sliding window).
2. ``_weighted_values``: per (row, KV head), the values are decoded block by block and each slot's value is added
   times its probability.

Between them PyTorch takes each query head's softmax over its row of logits: one float per slot and query head is all
that is ever written, never a dense copy of keys or values. The step's own key and value, which attention reads
exact, are added to the row in PyTorch. Storage is a layer's ``EntryStorage``: flat tensors, a segment per row and KV
head from ``starts`` with its own length. Importing this module needs Triton (tested on a CPU with
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PLAIN = 16  # the width a part stored as it is is given (its own dtype)
BLOCK = 64  # slots per program (logits) and per loop step (values)


@triton.jit
def _decoded(codes, scales, offsets, row, channel, code_bytes, groups,
             BITS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """Entries ``row`` ([BLOCK], flat slots) decoded at ``channel`` ([DIM]): float32 [BLOCK, DIM]."""
    rows = row[:, None]
    channels = channel[None, :]
    inside = channels < HEAD_DIM
    if BITS == 16:
        return tl.load(codes + rows * HEAD_DIM + channels, mask=inside, other=0.0).to(tl.float32)
    if BITS == 8:
        code = tl.load(codes + rows * code_bytes + channels, mask=inside, other=0).to(tl.int32)
    elif BITS < 4:  # four codes a byte, then at 3 bits the third bits, eight channels a byte
        byte = tl.load(codes + rows * code_bytes + channels // 4, mask=inside, other=0).to(tl.int32)
        code = (byte >> ((channels % 4) * 2)) & 3
        if BITS == 3:
            third = tl.load(codes + rows * code_bytes + HEAD_DIM // 4 + channels // 8, mask=inside, other=0)
            code = code | (((third.to(tl.int32) >> (channels % 8)) & 1) << 2)
    else:
        byte = tl.load(codes + rows * code_bytes + channels // 2, mask=inside, other=0).to(tl.int32)
        code = (byte >> ((channels % 2) * 4)) & 15
        if BITS == 5:  # the fifth bits, eight channels a byte after the low halves
            fifth = tl.load(codes + rows * code_bytes + HEAD_DIM // 2 + channels // 8, mask=inside, other=0)
            bit = (channels % 8) // 2 + 4 * (channels % 2)
            code = code | (((fifth.to(tl.int32) >> bit) & 1) << 4)
    group = rows * groups + channels // GROUP
    scale = tl.load(scales + group, mask=inside, other=0.0).to(tl.float32)
    offset = tl.load(offsets + group, mask=inside, other=0.0).to(tl.float32)
    return offset + code.to(tl.float32) * scale


@triton.jit
def _step_logits(
    queries, codes, scales, offsets, starts, counts, biases, positions, means, logits,
    kv_heads, group, slots, code_bytes, groups, scaling, softcap, query_position, window,
    BITS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM: tl.constexpr, GROUP_HEADS: tl.constexpr,
    BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_MEAN: tl.constexpr,
):  # fmt: skip
    block, unit = tl.program_id(0), tl.program_id(1)  # unit: row * kv_heads + head
    start = tl.load(starts + unit)
    count = tl.load(counts + unit)
    slot = block * BLOCK + tl.arange(0, BLOCK)
    live = slot < count
    row = start + tl.where(live, slot, 0)
    channel = tl.arange(0, DIM)
    keys = _decoded(codes, scales, offsets, row, channel, code_bytes, groups, BITS, GROUP, HEAD_DIM)
    if HAS_MEAN:  # smoothed keys: their mean back
        keys += tl.load(means + unit * HEAD_DIM + channel, mask=channel < HEAD_DIM, other=0.0)[None, :]
    head = tl.arange(0, GROUP_HEADS)
    first_head = unit * group  # (query heads of a row follow its KV heads, each ``group`` of them)
    query = tl.load(queries + (first_head + head)[:, None] * HEAD_DIM + channel[None, :],
                    mask=(head[:, None] < group) & (channel[None, :] < HEAD_DIM), other=0.0).to(tl.float32)  # fmt: skip
    value = tl.sum(query[:, None, :] * keys[None, :, :], axis=2) * scaling  # [GROUP_HEADS, BLOCK]
    if HAS_CAP:  # softcap * tanh(logit / softcap)
        value = softcap * (1.0 - 2.0 / (tl.exp(2.0 * value / softcap) + 1.0))
    if HAS_BIAS:
        value += tl.load(biases + row, mask=live, other=0.0).to(tl.float32)[None, :]
    if HAS_WINDOW:
        position = tl.load(positions + row, mask=live, other=0)
        live = live & (query_position - position < window)
    value = tl.where(live[None, :], value, float("-inf"))
    target = logits + (first_head + head)[:, None] * slots + slot[None, :]
    tl.store(target, value, mask=(head[:, None] < group) & (slot[None, :] < slots))


@triton.jit
def _weighted_values(
    probabilities, codes, scales, offsets, starts, counts, output,
    group, slots, code_bytes, groups,
    BITS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM: tl.constexpr, GROUP_HEADS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    unit = tl.program_id(0)
    start = tl.load(starts + unit)
    count = tl.load(counts + unit)
    channel = tl.arange(0, DIM)
    head = tl.arange(0, GROUP_HEADS)
    first_head = unit * group
    total = tl.zeros((GROUP_HEADS, DIM), dtype=tl.float32)
    for first in range(0, count, BLOCK):
        slot = first + tl.arange(0, BLOCK)
        live = slot < count
        row = start + tl.where(live, slot, 0)
        values = _decoded(codes, scales, offsets, row, channel, code_bytes, groups, BITS, GROUP, HEAD_DIM)
        weight = tl.load(probabilities + (first_head + head)[:, None] * slots + slot[None, :],
                         mask=(head[:, None] < group) & live[None, :], other=0.0)  # fmt: skip
        total += tl.sum(weight[:, :, None] * values[None, :, :], axis=1)
    target = output + (first_head + head)[:, None] * HEAD_DIM + channel[None, :]
    tl.store(target, total, mask=(head[:, None] < group) & (channel[None, :] < HEAD_DIM))


def _part(storage, part: str, bits: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """A part's flat tensors for the kernels: codes (or the plain entries), scales, offsets, code bytes and groups
    per entry, and its width (``PLAIN`` for a part stored as it is)."""
    codes = storage.flat[part]
    if bits is None:
        return codes, codes, codes, codes.shape[-1], 1, PLAIN
    prefix = part[:-1]
    scales, offsets = storage.flat[f"{prefix}_scales"], storage.flat[f"{prefix}_offsets"]
    return codes, scales, offsets, codes.shape[-1], scales.shape[-1], bits


def step_attention(
    query: torch.Tensor,
    storage,
    widths: tuple[int | None, int | None],
    group_size: int,
    own_keys: torch.Tensor,
    own_values: torch.Tensor,
    scaling: float,
    *,
    softcap: float | None = None,
    biased: bool = False,
    window: int | None = None,
    query_position: int = 0,
    key_means: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoding step's attention for ``query`` ``[batch, heads, 1, head_dim]`` over every entry each segment of
    ``storage`` stored before the step (its last entry is the step's own, read exact from ``own_keys`` and
    ``own_values``, ``[batch, kv_heads, 1, head_dim]``). ``widths``: the key and value bits (None: stored as they
    are); ``group_size``: channels per scale. Returns the output ``[batch, 1, heads, head_dim]`` in the query's dtype
    and each slot's probability summed over the query heads of its KV head, ``[batch, kv_heads, slots]`` (the step's
    own token at each segment's last slot). ``key_means``: smoothed keys' mean per row and KV head, float32
    ``[batch, kv_heads, 1, head_dim]``, added to each key decoded from its codes."""
    batch, heads, _, head_dim = query.shape
    kv_heads = storage.heads
    group = heads // kv_heads
    slots = storage.length_range[1]
    counts = (storage.lengths - 1).contiguous()  # the entries stored before the step
    starts = storage.starts.contiguous()
    dim, group_heads = triton.next_power_of_2(head_dim), max(triton.next_power_of_2(group), 1)
    shapes = {"GROUP": group_size, "HEAD_DIM": head_dim, "DIM": dim, "GROUP_HEADS": group_heads, "BLOCK": BLOCK}
    flat_query = query.reshape(batch * heads, head_dim).float().contiguous()
    logits = torch.empty((batch, heads, slots), dtype=torch.float32, device=query.device)
    codes, scales, offsets, code_bytes, groups, bits = _part(storage, "keys", widths[0])
    biases = storage.flat["biases"] if biased else codes
    positions = storage.flat["positions"]
    means = codes if key_means is None else key_means.float().contiguous()
    _step_logits[(triton.cdiv(slots, BLOCK), batch * kv_heads)](
        flat_query, codes, scales, offsets, starts, counts, biases, positions, means, logits,
        kv_heads, group, slots, code_bytes, groups, scaling, softcap or 1.0, query_position, window or 0,
        BITS=bits, HAS_BIAS=biased, HAS_CAP=softcap is not None, HAS_WINDOW=window is not None,
        HAS_MEAN=key_means is not None, **shapes,
    )  # fmt: skip
    # The step's own token, exact, at each segment's last slot (its bias is 0; it sees itself in any window).
    own = torch.matmul(query.float().reshape(batch, kv_heads, group, head_dim), own_keys.float().transpose(-1, -2))
    own = own.mul_(scaling).reshape(batch, heads, 1)
    if softcap is not None:
        own = own.div(softcap).tanh().mul(softcap)
    own_slot = counts.repeat_interleave(group, dim=1)[..., None]  # [batch, heads, 1]
    logits.scatter_(2, own_slot, own)
    probabilities = logits.softmax(dim=-1)
    output = torch.empty((batch, heads, head_dim), dtype=torch.float32, device=query.device)
    codes, scales, offsets, code_bytes, groups, bits = _part(storage, "values", widths[1])
    _weighted_values[(batch * kv_heads,)](
        probabilities, codes, scales, offsets, starts, counts, output, group, slots, code_bytes, groups,
        BITS=bits, **shapes,
    )  # fmt: skip
    own_weight = probabilities.gather(2, own_slot).reshape(batch, kv_heads, group, 1)
    output = output.reshape(batch, kv_heads, group, head_dim) + own_weight * own_values.float()
    received = probabilities.reshape(batch, kv_heads, group, slots).sum(dim=2)
    return output.reshape(batch, heads, 1, head_dim).transpose(1, 2).to(query.dtype), received

