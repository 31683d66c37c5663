"""How a row's size is shared among its layers and KV heads, from one ranking of comparable scores.

A uniform cache keeps the same number of tokens in every layer and head. Under ``allocation="layers"`` a row's
tokens, ``layers * target`` in all, go where the scores are highest: each layer offers its tokens in order of their
score averaged over its KV heads (its j-th best token is worth the mean of its heads' j-th best scores), one ranking
over every layer's offers picks which are kept, and every KV head of a layer keeps that layer's number. Under
``allocation="heads"`` every (layer, KV head) offers its own tokens, as KVzip allocates, and keeps its own number.
Each keeps at least ``floor`` of the even share.

The scores must mean the same thing everywhere: reconstruction scores (the most attention any replay query pays a
token, a probability) do; accumulated attention, whose scale differs from layer to layer, does not.

A new allocation is a function of the cache's layers here and a row in ``ALLOCATIONS``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch


def layer_counts(priorities: list[torch.Tensor], targets: torch.Tensor, floor: float) -> torch.Tensor:
    """``[units, rows]``: how many tokens each unit keeps per KV head, so that a row's units keep the sum of their
    targets in all (or every valid token, when they have fewer).

    Args:
        priorities: per unit, ``[rows, kv_heads, slots]`` scores; -inf for a slot that holds no entry. Units may
            have different slot counts.
        targets: ``[rows]`` the tokens a unit keeps per KV head under a uniform allocation, or ``[units, rows]``
            each unit's own (a sliding-window layer's is at most its window).
        floor: the least share of its target any unit keeps (or all its tokens), in [0, 1].

    Example:
        >>> flat = torch.full((1, 1, 4), 0.1)
        >>> sharp = torch.tensor([[[0.9, 0.8, 0.7, 0.0]]])
        >>> layer_counts([flat, sharp], torch.tensor([2]), floor=0.5).flatten().tolist()
        [1, 3]
    """
    rows = targets.shape[-1]
    slots = max(priority.shape[-1] for priority in priorities)
    offers = []  # per unit, [rows, slots]: the mean over heads of each head's j-th best score
    for priority in priorities:
        ordered = priority.double().sort(dim=-1, descending=True).values
        offer = ordered.mean(dim=1)  # -inf where a head has no j-th entry
        offers.append(_padded(offer, slots))
    offers = torch.stack(offers)  # [units, rows, slots]
    units = offers.shape[0]
    targets = targets.to(device=offers.device, dtype=torch.long).expand(units, rows)
    least = torch.ceil(floor * targets.double()).long()  # [units, rows]
    rank = torch.arange(slots, device=offers.device)
    floor_part = (rank < least[:, :, None]) & (offers > -math.inf)
    offers = torch.where(floor_part, math.inf, offers)  # each unit's floor comes first
    flat = offers.permute(1, 0, 2).reshape(rows, units * slots)
    order = flat.argsort(dim=-1, descending=True, stable=True)
    chosen = torch.arange(units * slots, device=flat.device) < targets.sum(dim=0)[:, None]
    chosen &= flat.gather(-1, order) > -math.inf  # never a slot no head holds
    kept = torch.zeros_like(chosen).scatter_(-1, order, chosen)
    return kept.reshape(rows, units, slots).sum(dim=-1).T.contiguous()


def _padded(offer: torch.Tensor, slots: int) -> torch.Tensor:
    """``offer`` ([rows, n]) extended with -inf to ``slots`` columns."""
    missing = slots - offer.shape[-1]
    if missing == 0:
        return offer
    return torch.cat([offer, offer.new_full((offer.shape[0], missing), -math.inf)], dim=-1)


def _ranked(layer) -> torch.Tensor:
    """A layer's eviction ranks, ``[rows, heads, slots]``, -inf past each segment's entries."""
    stop = layer.longest
    return torch.where(layer.storage.valid(stop), layer.priority(stop), -math.inf)


def _even_shares(layers) -> np.ndarray:
    """Host ``[layers, rows]``: the tokens each layer keeps per KV head under a uniform allocation (a sliding-window
    layer at most what its window holds)."""
    return np.stack([layer.policy.targets(layer.seen - layer.pads, layer.rows, layer.cap) for layer in layers])


def uniform(layers) -> None:
    """Every layer and head keeps the even share: nothing to decide."""


def by_layer(layers) -> None:
    """One ranking over the layers' offers; every KV head of a layer keeps the layer's number."""
    bases = _even_shares(layers)
    floor = layers[0].policy.allocation_floor
    counts = layer_counts([_ranked(layer) for layer in layers], torch.from_numpy(bases), floor).cpu().numpy()
    for layer, count, base in zip(layers, counts, bases, strict=True):
        layer.allocate(np.repeat(count[:, None], layer.storage.heads, axis=1), base)


def by_head(layers) -> None:
    """One ranking over every (layer, KV head)'s offers, as KVzip allocates; each keeps its own number."""
    bases = _even_shares(layers)
    units = [ranked[:, head : head + 1] for layer in layers for ranked in [_ranked(layer)]
             for head in range(ranked.shape[1])]  # fmt: skip
    floor = layers[0].policy.allocation_floor
    unit_bases = np.repeat(bases, [layer.storage.heads for layer in layers], axis=0)  # [layers * heads, rows]
    counts = layer_counts(units, torch.from_numpy(unit_bases), floor).cpu().numpy()  # [layers * heads, rows]
    start = 0
    for layer, base in zip(layers, bases, strict=True):
        heads = layer.storage.heads
        layer.allocate(counts[start : start + heads].T, base)
        start += heads


# name -> what it does to a cache's layers once their prompt is scored
ALLOCATIONS: dict[str, Callable] = {"uniform": uniform, "layers": by_layer, "heads": by_head}
