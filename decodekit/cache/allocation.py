"""One budget shared by all layers: how many tokens each layer keeps, from one ranking of comparable scores.

A uniform cache keeps the same number of tokens in every layer. Under ``allocation="global"`` a row's
tokens, ``layers * target`` in all, go where the scores are highest: each layer offers its tokens in
order of their score averaged over its KV heads (its j-th best token is worth the mean of its heads'
j-th best scores), and one ranking over every layer's offers picks which are kept. A layer keeps at
least ``floor`` of the even share. Every KV head of a layer then keeps the same number of tokens (each
its own best), so a layer's storage holds no empty slots and the memory freed is real.

The scores must mean the same thing in every layer: KVzip's reconstruction scores (the most attention
any replay query pays a token, a probability) do; accumulated attention, whose scale differs from
layer to layer, does not (measured in ``benchmarks/kv_allocation.py``).
"""

from __future__ import annotations

import math

import torch

ALLOCATIONS = ("uniform", "global", "heads")


def layer_counts(priorities: list[torch.Tensor], targets: torch.Tensor, floor: float) -> torch.Tensor:
    """``[layers, rows]``: how many tokens each layer keeps per KV head, so that a row's layers keep
    ``layers * targets[row]`` in all (or every live token, when it has fewer).

    Args:
        priorities: per layer, ``[rows, kv_heads, slots]`` scores; -inf for an entry that is not live.
            Layers may have different slot counts.
        targets: ``[rows]`` the tokens a layer keeps per KV head under a uniform allocation.
        floor: the least share of ``targets`` any layer keeps (or all its live tokens), in [0, 1].

    Example:
        >>> flat = torch.full((1, 1, 4), 0.1)
        >>> sharp = torch.tensor([[[0.9, 0.8, 0.7, 0.0]]])
        >>> layer_counts([flat, sharp], torch.tensor([2]), floor=0.5).flatten().tolist()
        [1, 3]
    """
    rows = targets.shape[0]
    slots = max(priority.shape[-1] for priority in priorities)
    offers = []  # per layer, [rows, slots]: the mean over heads of each head's j-th best score
    for priority in priorities:
        ordered = priority.double().sort(dim=-1, descending=True).values
        offer = ordered.mean(dim=1)  # -inf where a head has no j-th live entry
        offers.append(_padded(offer, slots))
    offers = torch.stack(offers)  # [layers, rows, slots]
    layers = offers.shape[0]
    targets = targets.to(device=offers.device, dtype=torch.long)
    least = torch.ceil(floor * targets.double()).long()  # [rows]
    rank = torch.arange(slots, device=offers.device)
    floor_part = (rank < least[None, :, None]) & (offers > -math.inf)
    offers = torch.where(floor_part, math.inf, offers)  # each layer's floor comes first
    flat = offers.permute(1, 0, 2).reshape(rows, layers * slots)
    order = flat.argsort(dim=-1, descending=True, stable=True)
    chosen = torch.arange(layers * slots, device=flat.device) < (layers * targets)[:, None]
    chosen &= flat.gather(-1, order) > -math.inf  # never a slot no head holds
    kept = torch.zeros_like(chosen).scatter_(-1, order, chosen)
    return kept.reshape(rows, layers, slots).sum(dim=-1).T.contiguous()


def _padded(offer: torch.Tensor, slots: int) -> torch.Tensor:
    """``offer`` ([rows, n]) extended with -inf to ``slots`` columns."""
    missing = slots - offer.shape[-1]
    if missing == 0:
        return offer
    return torch.cat([offer, offer.new_full((offer.shape[0], missing), -math.inf)], dim=-1)
