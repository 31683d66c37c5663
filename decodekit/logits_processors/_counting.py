"""Token counting shared by the penalties: how often each id in a window occurred, per row."""

from __future__ import annotations

import torch


def occurrence_counts(
    ids: torch.Tensor, vocab: int, counted: torch.Tensor | None = None, dtype: torch.dtype = torch.int32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, how often each of ``ids`` occurs among the ``counted`` positions of ``ids``.

    Returns ``(ids clamped to the vocabulary, occurrences)``, both ``[rows, len]``: the count of
    each position's (clamped) token, so a scatter at those positions writes one consistent value
    per token. Ids at or past ``vocab`` (an embedding larger than the output layer) never count.

    Example:
        >>> ids, counts = occurrence_counts(torch.tensor([[2, 0, 2, 7]]), vocab=4)
        >>> counts.tolist()
        [[2, 1, 2, 0]]
    """
    inside = ids < vocab
    counted = inside if counted is None else counted & inside
    ids = ids.clamp(max=vocab - 1)
    totals = torch.zeros((ids.shape[0], vocab), dtype=dtype, device=ids.device)
    totals.scatter_add_(1, ids, counted.to(dtype))
    return ids, totals.gather(1, ids)
