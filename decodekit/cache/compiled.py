"""A decoding step inside ``torch.compile``: the same step as an eager one, written on the device's state alone.

An eager step decides on the host (how long each segment is, whether a row is over its target) so that it reads
nothing back from the device. Inside a compiled graph a host number is a constant the graph is specialized on, and
one that changes at every step would make a graph per step (CUDA graphs record one per value). So a compiled step
reads only what does not change from step to step (the storage's capacity, the sizes, the attention module's shape)
and tensors: each segment's length and the tokens seen, counted on the device (shared with the host's counts on a
CPU; read back by the host when it next needs them elsewhere). It writes the new token at each segment's length,
attends over the whole capacity under a mask, scores at once (nothing waits), and evicts branch-free: a segment over
its target drops its lowest-ranked entries, the others move nothing (their lanes write the scratch slot).

It needs a capacity that does not change (a size fixed in tokens or bytes, segments of one capacity per layer) and no
padding held in place; the prompt's pass prepares both for a cache that evicts at every step (``is_compileable``).
"""

from __future__ import annotations

import math

import torch

from decodekit.cache.eviction import lowest, protect, removal_moves
from decodekit.cache.received import Visibility, attention_received, per_query


def check(layer) -> None:
    """Refuse what a compiled step cannot do, naming why (checked while the graph is traced)."""
    if layer.storage is None:
        raise ValueError("a CompressedCache's prompt pass must run eagerly before its compiled decoding steps")
    if not layer.static_capacity or not layer.storage.rectangular:
        raise ValueError(
            "compiled decoding steps need a size fixed in tokens or bytes (budget or max_bytes) and allocation "
            "'uniform' or 'layers': sizes that grow with the tokens seen, and heads of their own lengths, decode "
            "eagerly"
        )
    if layer.storage.capacity < layer.compiled_target() + 1:
        raise ValueError(
            "compiled decoding steps need the storage's whole room (the budget and a step's token): use "
            "eviction_interval=1, whose prompt pass makes it, or a prompt at least as long as the budget"
        )
    if layer.padding_held:
        raise ValueError(
            "compiled decoding steps of a left-padded batch need the padding dropped: use eviction_interval=1, or let "
            "the prompt's pass evict"
        )


def begin(layer, query_length: int) -> torch.Tensor:
    """The mask of a compiled step: each row and head sees its entries and the new token, which goes at its
    length, within the attention module's window; float offsets where entries carry biases."""
    check(layer)
    if query_length != 1:
        raise ValueError("compiled passes of a CompressedCache take one token at a time (decoding steps)")
    storage = layer.storage
    slot = torch.arange(storage.capacity, device=storage.device)
    lengths = storage.lengths[..., None]
    visible = slot <= lengths
    if layer.window is not None:
        positions = storage.tensor("positions").long()
        within = layer.seen_device - positions < layer.window
        visible &= torch.where(slot < lengths, within, slot == lengths)
    visible = visible[:, :, None, :]
    if not layer.biased:
        return visible
    biases = torch.where(slot < lengths, storage.tensor("biases").float(), 0.0)[:, :, None, :]
    return torch.where(visible, biases, -math.inf)


def update(layer, step, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store a compiled step's key and value at each segment's length; return the whole capacity as attention reads
    it (the storage itself where entries are held as they are)."""
    storage, coding = layer.storage, layer.coding
    batch, heads = key_states.shape[:2]
    fields, read_keys = coding.encode(key_states, value_states)
    slot = storage.lengths.clone()
    position = layer.seen_device.to(torch.int32).expand(batch, heads, 1)
    entries = {**fields, "positions": position, **layer.scorer.new_entries(value_states)}
    if "biases" in storage.fields:
        entries["biases"] = 0.0
    storage.write_slots(slot[..., None], entries)
    storage.lengths.add_(1)
    layer.seen_device.add_(1)
    step.new_slots = slot
    if coding.quantized:
        coding.remember(read_keys, value_states, position[0, 0])
    if coding.reads_in_place():
        return storage.tensor("keys"), storage.tensor("values")
    keys, values = coding.decode(storage, storage.capacity, storage.valid(storage.capacity))
    rows = torch.arange(batch, device=keys.device)[:, None]
    columns = torch.arange(heads, device=keys.device)[None, :]
    keys[rows, columns, slot] = read_keys[:, :, 0].to(keys.dtype)  # (index_put_: written in place)
    values[rows, columns, slot] = value_states[:, :, 0].to(values.dtype)
    return keys, values


def end(layer, step) -> None:
    """Score a compiled step at once and evict branch-free; the host reads the counts back when it next needs them."""
    storage, size = layer.storage, layer.options.size
    layer.scorer.flush(layer)  # steps an eager decoding left waiting come first (a graph per count of them)
    capacity = storage.capacity
    valid = storage.valid(capacity)
    seen = layer.seen_device
    positions = storage.tensor("positions")
    queries = step.queries()
    visibility = Visibility(positions, seen - 1, valid, None, layer.window)
    received = attention_received(queries, step.keys, step.scaling, visibility, softcap=layer.softcap,
                                  biases=layer.stored_biases(capacity, valid))  # fmt: skip
    group = queries.shape[1] // step.keys.shape[1]
    received = per_query(received, positions, seen, 1, group, layer.window)
    scores = storage.tensor("scores")
    scores.mul_(layer.scorer.decay).add_(received)
    lengths = storage.lengths
    target = layer.compiled_target()  # an int, or a tensor per row and head under a shared allocation
    after = target - layer.interval + 1
    after = after.clamp(min=layer.policy.floor) if isinstance(after, torch.Tensor) else max(after, layer.policy.floor)
    keep = torch.where(lengths > target, after, lengths)
    importance = layer.scorer.importance(layer, capacity)
    pads = layer.pads_device[:, None, None]
    priority = protect(importance, positions, seen, size.sink_tokens, size.recent_tokens, pads, layer.window)
    victims = lowest(priority, valid, layer.interval)
    sources, targets, lanes = removal_moves(victims, lengths, lengths - keep)
    storage.move(sources, targets, lanes)
    lengths.copy_(keep)
    storage.mark_stale()
    layer.mark_host_stale()  # (and the host's plans for the next eager steps no longer hold)
