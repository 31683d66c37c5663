"""Rotary position embedding of queries, as the attention modules the cache observes apply it."""

from __future__ import annotations

import threading
import weakref

import torch

from decodekit.cache.quantize import rotate as hadamard_rotate


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
    rotated, kept = queries[..., :rotary], queries[..., rotary:]
    return torch.cat([rotated * cos + rotate_half(rotated) * sin, kept], dim=-1)


def rotated_query_columns(columns: torch.Tensor, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Query columns ``[batch, tokens, heads * head_dim]`` changed so that the attention module's own rotary
    embedding (``cos``, ``sin``: ``[batch, tokens, rotary]``) makes of them the rotary queries rotated by the
    Hadamard matrix that coded keys are rotated by (``quantize.rotate``): rotated, rotated, rotated back.

    Attention scores are unchanged when queries and keys are rotated by the same orthonormal matrix, so a
    layer whose queries are rotated this way reads its coded keys without rotating them back.

    Example:
        >>> columns, angles = torch.randn(1, 3, 8), torch.rand(1, 3, 2).repeat(1, 1, 2)  # 2 heads of 4; 3 tokens
        >>> cos, sin = angles.cos(), angles.sin()
        >>> rotary = lambda x: rotate(x.view(1, 3, 2, 4), cos[:, :, None], sin[:, :, None])
        >>> rotated = rotary(rotated_query_columns(columns, 4, cos, sin))
        >>> torch.allclose(rotated, hadamard_rotate(rotary(columns)), atol=1e-5)
        True
    """
    batch, tokens, _ = columns.shape
    queries = columns.float().view(batch, tokens, -1, head_dim)
    if tokens == 1:  # a decoding step: one product with the step's matrix, made once for all layers
        rotated = torch.matmul(queries, _step_rotation(head_dim, cos, sin)[:, None])
        return rotated.view(batch, tokens, -1).to(columns.dtype)
    return _rotated(queries, cos, sin).view(batch, tokens, -1).to(columns.dtype)


def _rotated(queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``queries`` ``[batch, tokens, heads, head_dim]`` (float32) rotated, rotated and rotated back."""
    cos, sin = cos.float()[:, :, None], sin.float()[:, :, None]
    return rotate(hadamard_rotate(rotate(queries, cos, sin)), cos, -sin)


# The last decoding step's rotating matrices, with (weak references to) the rotary embedding they were made for:
# the model hands every layer of a forward pass the same ``cos`` and ``sin`` tensors.
_STEP_ROTATION = threading.local()


def _step_rotation(head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``[batch, head_dim, head_dim]``: per row, the matrix that a one-token pass's query rows (``[..., head_dim]``)
    are multiplied by to be rotated, rotated and rotated back (``_turned`` of the identity's rows).

    Eager, it is made once per pass and kept for the pass's other layers. Inside a compiled step it is not kept: a
    step's graph would return the matrix and the embedding it was made for, to store them, and a CUDA graph
    overwrites what it returned when it runs again; the compiler makes it once per graph all the same."""
    compiling = torch.compiler.is_compiling()
    made = None if compiling else getattr(_STEP_ROTATION, "made", None)
    if made is not None and made[0]() is cos and made[1]() is sin and made[2].shape[-1] == head_dim:
        return made[2]
    batch = cos.shape[0]
    identity = torch.eye(head_dim, device=cos.device).expand(batch, 1, head_dim, head_dim)
    matrix = _rotated(identity, cos, sin)[:, 0]  # row i: the i-th unit query rotated, rotated and rotated back
    if not compiling:
        _STEP_ROTATION.made = (weakref.ref(cos), weakref.ref(sin), matrix)
    return matrix
