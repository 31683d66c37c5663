"""Which entries go: protection of the attention sinks and the recent window, and the moves that free the slots.

Every function here works on tensors ``[batch, kv_heads, slots]`` whose first ``lengths[b, h]`` slots hold
entries (``EntryStorage``'s segments), whatever their order.
"""

from __future__ import annotations

import math

import torch

PROTECTED = 1.0e30  # the priority of sink and recent tokens: above any score


def protect(
    priority: torch.Tensor,
    positions: torch.Tensor,
    seen: int | torch.Tensor,
    sink_tokens: int,
    recent_tokens: int,
    pads: int | torch.Tensor = 0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``priority`` with the sink tokens (the first ``sink_tokens`` after a row's ``pads``) and the recent ones (the
    last ``recent_tokens`` of the ``seen``) raised above every score, and, under a ``sliding_window``, the tokens no
    later query can see lowered below every score.

    Example:
        >>> protect(torch.tensor([0.5, 0.1, 0.2, 0.3]), torch.arange(4), seen=4, sink_tokens=1, recent_tokens=1)
        tensor([1.0000e+30, 1.0000e-01, 2.0000e-01, 1.0000e+30])
    """
    protected = (positions < pads + sink_tokens) | (positions >= seen - recent_tokens)
    priority = torch.where(protected, PROTECTED, priority)
    if sliding_window is not None:
        priority = torch.where(positions <= seen - sliding_window, -PROTECTED, priority)
    return priority


def rank_fractions(values: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per row and head, each entry's rank by ``values`` among the ``valid`` entries (all when None), as a float64
    fraction in [0, 1); other entries get negative fractions. Ties go by slot order.

    Example:
        >>> rank_fractions(torch.tensor([[[0.3, 0.1, 0.2, 0.0]]]), torch.tensor([[[True, True, True, False]]]))
        tensor([[[ 0.6667,  0.0000,  0.3333, -0.3333]]], dtype=torch.float64)
    """
    if valid is None:
        order = values.argsort(dim=-1, stable=True).argsort(dim=-1)
        return order.double() / values.shape[-1]
    count = valid.sum(dim=-1, keepdim=True)
    order = torch.where(valid, values.double(), -math.inf).argsort(dim=-1, stable=True).argsort(dim=-1)
    return (order - (valid.shape[-1] - count)).double() / count.clamp(min=1)


def lowest(priority: torch.Tensor, valid: torch.Tensor, count: int) -> torch.Tensor:
    """The slots of each row and head's ``count`` lowest-priority valid entries, ``[..., count]``, lowest first: a
    reduction for one (a compiled step fuses it), a top-k otherwise.

    Example:
        >>> lowest(torch.tensor([[0.5, 0.1, 0.9, 0.0]]), torch.tensor([[True, True, True, False]]), 2).tolist()
        [[1, 0]]
    """
    ranked = torch.where(valid, priority, math.inf)
    if count == 1:
        return ranked.argmin(dim=-1, keepdim=True)
    return ranked.topk(count, dim=-1, largest=False).indices


def best_in_slot_order(
    priority: torch.Tensor, valid: torch.Tensor, count: int, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """The slots of each row and head's ``count`` highest-priority valid entries, in slot order (``[..., count]``);
    with ``counts`` (``[...]``), only each one's ``counts`` best come first, in slot order, and the slots after them
    are filler.

    Example:
        >>> priority, valid = torch.tensor([[0.5, 0.1, 0.9, 0.3, 0.7]]), torch.ones(1, 5, dtype=torch.bool)
        >>> best_in_slot_order(priority, valid, 3), best_in_slot_order(priority, valid, 3, torch.tensor([2]))[:, :2]
        (tensor([[0, 2, 4]]), tensor([[2, 4]]))
    """
    slots = priority.shape[-1]
    ranked = torch.where(valid, priority, -math.inf).topk(count, dim=-1).indices
    if counts is not None:
        ranked = torch.where(torch.arange(count, device=ranked.device) < counts[..., None], ranked, slots)
    return ranked.sort(dim=-1).values.clamp_(max=slots - 1)


def removal_moves(
    victims: torch.Tensor, lengths: torch.Tensor, drops: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The moves that remove ``drops[b, h]`` entries, the first ``drops`` of ``victims[b, h]`` (``[batch, heads,
    n]``, n >= every drop), from segments of ``lengths``: each entry of the segment's last ``drops`` slots that stays
    moves into the slot of a victim before them, so the segment keeps its first ``lengths - drops`` slots and at most
    ``n`` entries move. Returns ``(sources, targets, lanes)``, ``lanes`` True for the moves to make.

    Example:
        >>> sources, targets, lanes = removal_moves(torch.tensor([[[1, 4]]]), torch.tensor([[5]]), torch.tensor([[2]]))
        >>> sources[lanes].tolist(), targets[lanes].tolist()  # slot 3 stays: it takes slot 1; slot 4 was a victim
        ([3], [1])
    """
    count = victims.shape[-1]
    if count == 1:  # one victim at most (an eviction at every step): the last entry moves into its slot
        tail = (lengths - drops)[..., None]
        movers = (drops[..., None] > 0) & (victims != tail)
        return tail, torch.where(movers, victims, tail), movers
    lane = torch.arange(count, device=victims.device)
    real = lane < drops[..., None]
    tail = lengths[..., None] - drops[..., None] + lane  # the slots past the new length
    beyond = torch.iinfo(victims.dtype).max
    ordered = torch.where(real, victims, beyond).sort(dim=-1).values  # the victims before the tail come first
    tail_is_victim = (tail[..., :, None] == ordered[..., None, :]).any(dim=-1)
    movers = real & ~tail_is_victim
    rank = (movers.cumsum(dim=-1) - 1).clamp(min=0)
    holes = ordered.gather(-1, rank)
    return tail, torch.where(movers, holes, tail), movers
