"""Attention that reads a layer's entries where they lie, through transformers' ``AttentionInterface``.

A layer whose entries attention cannot read as they are (codes and group scales, or KV heads of their own lengths)
would have to hand the attention module a dense copy of every entry at every step. Instead, for a decoding step, it
computes the step's attention itself: decodekit wraps the "sdpa" attention function once, and the wrapper, when a
layer expects a read for the calling module (``expect``), lets the layer compute it (on CUDA with a Triton kernel
that reads the codes in place, ``_triton_attention.py``; elsewhere decoding the codes in blocks); for any other call
it calls the original function with the same arguments, so every other cache and model is unchanged.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

WRAPPED = "sdpa"  # the attention implementation whose calls a layer may answer itself


class _Reads(threading.local):
    """Per thread, the reads layers expect, by attention module id (a fresh dict in each thread)."""

    def __init__(self) -> None:
        self.reads: dict[int, Callable[[torch.Tensor, float], torch.Tensor]] = {}


_READS = _Reads()
_ORIGINAL: dict[str, Callable] = {}


def install() -> None:
    """Wrap the "sdpa" attention function once (process-wide; calls no layer expects go to the original)."""
    if WRAPPED in _ORIGINAL:
        return
    _ORIGINAL[WRAPPED] = ALL_ATTENTION_FUNCTIONS[WRAPPED]
    ALL_ATTENTION_FUNCTIONS[WRAPPED] = _attention


def answers(module: torch.nn.Module) -> bool:
    """Whether ``module``'s attention calls reach the wrapper (its model runs "sdpa" attention)."""
    config = getattr(module, "config", None)
    return WRAPPED in _ORIGINAL and getattr(config, "_attn_implementation", None) == WRAPPED


def expect(module_id: int, read: Callable) -> None:
    """Let ``read(query, scaling, mask)`` answer the next attention call of the module ``module_id`` in this thread:
    it returns the output, ``[batch, query_length, heads, head_dim]``."""
    _READS.reads[module_id] = read


def pending(module_id: int) -> bool:
    """Whether a read expected for a module was not taken (its attention call did not reach the wrapper)."""
    return _READS.reads.pop(module_id, None) is not None


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The wrapped "sdpa" attention: a layer's own read where one is expected for ``module``, else the original."""
    read = _READS.reads.pop(id(module), None) if _READS.reads else None
    if read is None:
        return _ORIGINAL[WRAPPED](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)  # fmt: skip
    return read(query, module.scaling if scaling is None else scaling, attention_mask), None


def read_decoded(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    mask: torch.Tensor | None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoding step's attention over decoded ``keys`` and ``values`` ``[batch, kv_heads, slots, head_dim]`` (float32)
    for ``query`` ``[batch, heads, 1, head_dim]``, with the pass's ``mask`` (per KV head ``[batch, kv_heads, 1,
    slots]`` or per query head ``[batch, heads, 1, slots]``, boolean or logit offsets; None: every slot) and a logit
    cap. Returns the output ``[batch, 1, heads, head_dim]`` in the query's dtype and each entry's probability summed
    over the query heads that share its KV head, ``[batch, kv_heads, slots]``, for its score.

    Example:
        >>> keys, values = torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
        >>> output, received = read_decoded(torch.randn(1, 2, 1, 4), keys, values, 0.5, None)
        >>> output.shape, round(float(received.sum()), 4)
        (torch.Size([1, 1, 2, 4]), 2.0)
    """
    batch, heads, _, head_dim = query.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    grouped = query.float().reshape(batch, kv_heads, group, head_dim)
    logits = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(scaling)  # [batch, kv_heads, group, slots]
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    if mask is not None:
        if mask.shape[1] == heads and heads != kv_heads:  # (a mask per query head: grouped)
            mask = mask.reshape(batch, kv_heads, group, slots)
        logits = logits.masked_fill_(~mask, -math.inf) if mask.dtype == torch.bool else logits.add_(mask)
    probabilities = logits.softmax(dim=-1)
    output = torch.matmul(probabilities, values)  # [batch, kv_heads, group, head_dim]
    output = output.reshape(batch, heads, 1, head_dim).transpose(1, 2).to(query.dtype)
    return output, probabilities.sum(dim=2)
