"""Rotary position embedding of queries, as the attention modules the cache observes apply it."""

from __future__ import annotations

import torch


def rotate_half(tensor: torch.Tensor) -> torch.Tensor:
    """The second half of the last dimension, negated, followed by the first half."""
    first, second = tensor.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotate(queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the first ``cos.shape[-1]`` dimensions (all of them, or a partial rotary part).

    Example:
        >>> queries = torch.tensor([[1.0, 0.0]])
        >>> rotate(queries, torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]]))  # a quarter turn
        tensor([[0., 1.]])
    """
    rotary = cos.shape[-1]
    if rotary == queries.shape[-1]:
        return queries * cos + rotate_half(queries) * sin
    turned, kept = queries[..., :rotary], queries[..., rotary:]
    return torch.cat([turned * cos + rotate_half(turned) * sin, kept], dim=-1)
