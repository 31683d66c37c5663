"""Evicting every layer at once while decoding.

Between evictions a decoding step writes one key and one value per layer; an eviction scores the waiting
steps, ranks the entries and moves the kept ones to the front, a few dozen operators per layer, which a
16-layer model on a GPU pays 16 times. When the layers of a uniform cache reserve room, :class:`SharedRoom`
hands each layer its slice of one tensor per entry kind (``[layers, batch, kv_heads, room, ...]``); a layer
due an eviction into that room waits, and the last layer's pass evicts every waiting layer with one operator
per step instead of one per layer (:func:`evict_together`). It keeps what each layer would keep alone, and
any layer in another state (padding, a sliding window, rows reordered by beam search...) evicts alone.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from decodekit.cache.rotary import rotate
from decodekit.cache.scoring import best_in_slot_order, protect, waiting_attention
from decodekit.cache.storage import PARTS, move_tail_into, prepare_room, slot_rows, take_slots

CompressedLayer = Any  # a decodekit.cache.layer.CompressedLayer (not imported: that module imports this one)


class SharedRoom:
    """The reserved room of a cache's layers, as slices of shared tensors, and the evictions waiting for the
    last layer. ``layers`` is set by the cache once its layers exist."""

    def __init__(self) -> None:
        self.layers: list[CompressedLayer] = []
        # Per entry kind: the shared tensor now handed out (held weakly: the layers' slices keep it alive),
        # and the layers that took their slice of it.
        self._bases: dict[str, weakref.ref] = {}
        self._handed: dict[str, set[int]] = {}
        self._due: dict[int, int] = {}  # layer index -> entries each row keeps, for layers whose eviction waits

    def room(self, index: int, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s new room for entry kind ``name``, ``shape``, with ``like``'s dtype and device: its
        slice of the shared tensor, a new one when it already took its slice of that one; a tensor of its own
        when its shape differs from the other layers', or under ``torch.compile`` (whose graphs take layers' slices of
        one tensor as aliased inputs, which inductor refuses to mutate)."""
        if torch.compiler.is_compiling():
            return like.new_empty(shape)
        base = self._bases[name]() if name in self._bases else None
        fits = base is not None and base.shape[1:] == shape and base.dtype == like.dtype and base.device == like.device
        if base is not None and not fits and index not in self._handed[name]:
            return like.new_empty(shape)
        if not fits or index in self._handed[name]:
            base = like.new_empty((len(self.layers), *shape))
            self._bases[name], self._handed[name] = weakref.ref(base), set()
        self._handed[name].add(index)
        return base[index]

    def base_of(self, name: str, index: int, tensor: torch.Tensor) -> torch.Tensor | None:
        """The shared tensor behind ``tensor`` when it is layer ``index``'s slice of it, else None (always under
        ``torch.compile``, which cannot trace the comparison of data pointers: the layers then evict one by one, in
        the compiled step)."""
        if torch.compiler.is_compiling():
            return None
        base = self._bases[name]() if name in self._bases else None
        if base is None or tensor.data_ptr() != _slice_address(base, index):
            return None
        return base

    def defer(self, layer: CompressedLayer, keep: int) -> None:
        """Let ``layer``'s eviction into its room (each row down to ``keep`` entries) wait for the last layer's
        pass, which evicts every waiting layer (``evict_due``)."""
        self._due[layer.shared_index] = keep

    def evict_due(self) -> None:
        """Evict the waiting layers: all at once when every layer waits in the same state, else one by one."""
        if not self._due:
            return
        due, self._due = self._due, {}
        layers = [self.layers[index] for index in sorted(due)]
        keeps = set(due.values())
        if len(layers) == len(self.layers) and len(keeps) == 1:
            bases = self._together(layers)
            if bases is not None:
                evict_together(layers, bases, keeps.pop())
                return
        for layer in layers:
            layer.keep_best(due[layer.shared_index])

    def _together(self, layers: list[CompressedLayer]) -> dict[str, torch.Tensor] | None:
        """The shared tensors, when every layer's entries are its slices of them and the layers are alike:
        the same slots, tokens seen, waiting steps (with the same rotation) and queries' scaling, plain
        causal attention over every entry (no padding, window, cap or pooling), storage in the model's
        dtype and attention scores alone (no novelty ranks, no replay)."""
        first = layers[0]
        policy = first.policy
        if policy.scoring != "attention" or policy.pool_kernel != 1 or not first._pending or not first._has_spare():
            return None
        bases = {}
        for name in first.entries:
            base = self.base_of(name, first.shared_index, first._spare[name])
            if base is None:
                return None
            bases[name] = base
        # Where each layer's slice of each shared tensor starts: the first slice's address, a slice's size apart.
        starts = [(name, base.data_ptr(), base.stride(0) * base.element_size()) for name, base in bases.items()]
        rotations = [(cos, sin) for _, cos, sin in first._pending.steps]
        for layer in layers:
            alike = (
                layer.slots == first.slots and layer.seen == first.seen and layer.entries == first.entries
                and not layer.quantized and layer.storage_dtype == layer.dtype == first.dtype
                and layer.pad_range[1] == 0 and layer.sliding_window is None and layer.softcap is None
                and not layer.replaying and len(layer._pending.steps) == len(rotations) and not layer._pending.count
                and layer._pending.scaling == first._pending.scaling
                and layer._has_spare()
            )  # fmt: skip
            if not alike:
                return None
            index, spare = layer.shared_index, layer._spare
            if any(spare[name].data_ptr() != start + index * step for name, start, step in starts):
                return None
            for (_, cos, sin), (shared_cos, shared_sin) in zip(layer._pending.steps, rotations, strict=True):
                if cos is not shared_cos or sin is not shared_sin:
                    return None
        return bases


def _slice_address(base: torch.Tensor, index: int) -> int:
    """Where layer ``index``'s slice ``base[index]`` of a shared tensor starts, without making the slice."""
    return base.data_ptr() + index * base.stride(0) * base.element_size()


@torch.no_grad()
def evict_together(layers: list[CompressedLayer], bases: dict[str, torch.Tensor], keep: int) -> None:
    """Evict every layer (all alike, see ``SharedRoom._together``) down to ``keep`` entries per row and KV head
    at once, on the shared tensors ``bases`` (``[layers, batch, kv_heads, room, ...]`` per entry kind): score
    the waiting steps, rank (sinks and recent tokens first, then score times value norm), keep the best at the
    front (the waiting steps' tokens filling the victims' slots where they all stay, else in slot order) and prepare
    the room after them, as each layer's ``keep_best`` would."""
    first = layers[0]
    policy, slots, seen = first.policy, first.slots, first.seen
    steps, decay = len(first._pending), policy.score_decay
    start = slots - steps  # the waiting steps' tokens: the last slots
    # [layers * steps, batch, 1, -]
    columns = torch.stack([step[0] for layer in layers for step in layer._pending.steps])
    columns = columns.view(len(layers), steps, *columns.shape[1:]).squeeze(3).transpose(1, 2)
    make = first._to_queries
    if all(layer._to_queries is make for layer in layers):  # the same for every layer: made at once
        queries = make(columns.flatten(0, 1)).unflatten(0, columns.shape[:2])
    else:
        queries = torch.stack([layer._to_queries(part) for layer, part in zip(layers, columns, strict=True)])
    cos, sin = (torch.cat(parts, dim=1) for parts in zip(*(step[1:] for step in first._pending.steps), strict=True))
    queries = rotate(queries, cos.unsqueeze(1), sin.unsqueeze(1))  # [layers, batch, heads, steps, head_dim]
    received = waiting_attention(queries, bases["keys"], start, first._pending.scaling, decay)
    visible = start + steps
    scores = bases["_scores"].narrow(3, 0, slots)
    torch.add(received, scores[..., :visible], alpha=decay**steps, out=scores[..., :visible])  # decayed, then added
    if "_value_norms" in bases:
        values = bases["values"].narrow(3, start, steps)
        torch.linalg.vector_norm(values, dim=-1, dtype=torch.float32, out=bases["_value_norms"].narrow(3, start, steps))
    positions = bases["_positions"].narrow(3, 0, slots)
    if policy.ranks_by_value_norm:
        scores = scores * bases["_value_norms"].narrow(3, 0, slots)
    priority = protect(scores, positions, seen, policy.sink_tokens, policy.recent_tokens)
    moved = bases
    if any(layer.live_range[0] < slots for layer in layers):  # a row holds dead slots
        priority = torch.where(bases["_live"].narrow(3, 0, slots), priority, -math.inf)
    else:  # every slot of the room is live (the unfilled ones were prepared so) and stays so: nothing to move
        moved = {name: base for name, base in bases.items() if name != "_live"}
    room = bases["keys"].shape[3]  # every entry kind has the same room
    if policy.victims_precede_newest(slots - keep, steps, keep):  # the waiting steps' tokens fill the victims' slots
        victims = priority.topk(slots - keep, dim=-1, largest=False).indices
        rows = slot_rows(victims, room)
        for base in moved.values():
            move_tail_into(base, 3, keep, rows)
    else:
        index = best_in_slot_order(priority, keep)  # [layers, batch, kv_heads, keep]
        rows = slot_rows(index, room)
        for base in moved.values():
            base.narrow(3, 0, keep).copy_(take_slots(base, index, rows))
    prepare_room(moved, 3, keep, seen)
    for layer in layers:
        layer._pending.clear()
        layer._forget_freed()
        for name in PARTS:  # the bookkeeping views follow when read (``_catch_up``)
            layer._place(name, layer._room_view(name, 0, keep))
        layer._lagging = True
        # The next steps append to the room with their scoring waiting, as after any step that did (all live, none
        # waiting, room after the kept entries): they need not check again.
        layer._plain_steps, layer._plain_view = layer._plain_steps_left(), layer.keys
