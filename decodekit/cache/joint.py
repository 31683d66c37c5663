"""Evicting every layer of a cache at once while decoding.

Between evictions a decoding step writes one key and one value per layer; an eviction scores the waiting steps,
ranks the entries and moves the kept ones into the victims' slots: a few dozen operators per layer, which a
16-layer model pays 16 times. A ``LayerGroup`` hands the layers' storages their tensors as slices of one tensor per
field, ``[layers, slots, ...]`` (``allocate``); a layer due an eviction in a decoding step waits
(``defer``), and the last layer's pass evicts every waiting layer with one operator per step for all of them
(``evict_due``). It keeps what each layer keeps alone; layers in any other state (padding held, a sliding window,
coded or biased entries, heads of their own lengths, storages no longer slices of one tensor...) evict alone.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from decodekit.cache.eviction import lowest, protect, removal_moves

CompressedLayer = Any  # a decodekit.cache.layer.CompressedLayer (not imported: that module imports this one)


@dataclass(frozen=True)
class Eviction:
    """What a layer's eviction keeps: host ``[batch, heads]`` ``targets`` and ``keep`` (entries left after it)
    and ``drops`` (entries that go), and ``most``, the most any segment drops."""

    targets: np.ndarray
    keep: np.ndarray
    drops: np.ndarray
    most: int


class LayerGroup:
    """A cache's layers, whose storages take their tensors from shared ones and evict together while decoding.

    Example (what ``CompressedCache`` does)::

        group = LayerGroup(layers)   # each layer then allocates through group.allocator(layer)
        ...                          # a decoding step: layers defer their evictions, the last one evicts them all
    """

    def __init__(self, layers: list[CompressedLayer]) -> None:
        self.layers = layers
        self._index = {id(layer): index for index, layer in enumerate(layers)}
        # Per field: the shared tensor now handed out (held weakly: the layers' slices keep it alive) and the layers
        # that took their slice of it.
        self._shared: dict[str, weakref.ref] = {}
        self._taken: dict[str, set[int]] = {}
        self.due: dict[int, Eviction] = {}  # layer index -> its waiting eviction

    def __deepcopy__(self, memo: dict) -> LayerGroup:
        """A copy for the copied layers: the copied storages share their memory as the originals do, and
        ``evict_due`` finds that out from the tensors themselves. (The layers are copied one by one into a new list:
        the cache's own list of them may be the one being copied, not yet filled.)"""
        copied = LayerGroup([])
        memo[id(self)] = copied
        copied.layers = [copy.deepcopy(layer, memo) for layer in self.layers]  # (a list of its own: see below)
        copied._index = {id(layer): index for index, layer in enumerate(copied.layers)}
        copied.due = copy.deepcopy(self.due, memo)
        return copied

    # -- memory -----------------------------------------------------------------------------------------------------

    def allocator(self, layer: CompressedLayer):
        """An ``storage.Allocate`` for ``layer``: each field's tensor as its slice of a shared one."""
        index = self._index[id(layer)]

        def allocate(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self._slice(index, name, shape, dtype, device)

        return allocate

    def _slice(self, index: int, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """Layer ``index``'s zeroed slice for field ``name``: of the shared tensor now handed out where it fits and
        this layer has not taken its slice of it yet; the first layer starts a new one (layers lay out their storages
        in order); any other layer gets a tensor of its own."""
        shared = self._shared[name]() if name in self._shared else None
        fits = (shared is not None and tuple(shared.shape[1:]) == tuple(shape) and shared.dtype == dtype
                and shared.device == torch.device(device) and index not in self._taken[name])  # fmt: skip
        if not fits and index != 0:
            return torch.zeros(shape, dtype=dtype, device=device)
        if not fits:
            shared = torch.zeros((len(self.layers), *shape), dtype=dtype, device=device)
            self._shared[name], self._taken[name] = weakref.ref(shared), set()
        self._taken[name].add(index)
        return shared[index]  # (each slice is handed out once: it holds zeros)

    # -- eviction ---------------------------------------------------------------------------------------------------

    def defer(self, layer: CompressedLayer, eviction: Eviction) -> bool:
        """Let ``layer``'s eviction after a decoding step wait for the last layer's pass (True), or say that it
        cannot wait (False: the layer cannot evict with the others)."""
        index = self._index.get(id(layer))
        if index is None or len(self.layers) == 1 or not layer.evicts_together():
            return False
        self.due[index] = eviction
        return True

    def after_pass(self, layer: CompressedLayer) -> None:
        """After a decoding step's pass through ``layer``: the last layer's evicts every waiting layer."""
        if self.due and self._index.get(id(layer)) == len(self.layers) - 1:
            self.evict_due()

    def evict_due(self) -> None:
        """Evict the waiting layers: all at once where every layer waits in the same state, else one by one."""
        if not self.due:
            return
        due, self.due = self.due, {}
        layers = [self.layers[index] for index in sorted(due)]
        evictions = [due[index] for index in sorted(due)]
        shared = None
        if len(layers) == len(self.layers) and _alike(layers, evictions):
            shared = _stacked(layers)
        if shared is None:
            for layer, eviction in zip(layers, evictions, strict=True):
                layer.evict_now(eviction)
            return
        _evict_together(layers, evictions[0], shared)


def _alike(layers: list[CompressedLayer], evictions: list[Eviction]) -> bool:
    """Whether the layers evict alike: the same tokens seen, the same lengths and keep, scorers of one kind with the
    same waiting steps."""
    first, eviction = layers[0], evictions[0]
    kind = type(first.scorer)
    waiting = first.scorer.waiting_state()
    return waiting is not None and first.moves_few(eviction) and all(
        layer.seen == first.seen and layer.longest == first.longest and other.most == eviction.most
        and np.array_equal(other.keep, eviction.keep) and type(layer.scorer) is kind
        and layer.scorer.waiting_state() == waiting
        for layer, other in zip(layers, evictions, strict=True)
    )  # fmt: skip


def _stacked(layers: list[CompressedLayer]) -> dict[str, torch.Tensor] | None:
    """Per field, every layer's flat storage tensor as one ``[layers, slots, ...]`` view, where they are consecutive
    slices of one tensor (``LayerGroup.allocate``) in one layout; else None."""
    storages = [layer.storage for layer in layers]
    first = storages[0]
    if any(storage.capacity != first.capacity or storage.batch != first.batch or not storage.rectangular
           or storage.flat.keys() != first.flat.keys() for storage in storages):  # fmt: skip
        return None
    stacked = {}
    for name, tensor in first.flat.items():
        step = tensor.numel() * tensor.element_size()
        base = tensor.untyped_storage().data_ptr()
        for index, storage in enumerate(storages):
            other = storage.flat[name]
            if (other.shape != tensor.shape or other.dtype != tensor.dtype
                    or other.untyped_storage().data_ptr() != base
                    or other.data_ptr() != tensor.data_ptr() + index * step):  # fmt: skip
                return None
        stacked[name] = tensor.as_strided((len(storages), *tensor.shape), (tensor.numel(), *tensor.stride()))
    return stacked


@torch.no_grad()
def _evict_together(layers: list[CompressedLayer], eviction: Eviction, flat: dict[str, torch.Tensor]) -> None:
    """The eviction each layer makes alone (``CompressedLayer.evict_now``, moving a few entries), for all of them
    at once over their stacked storages ``flat``."""
    first = layers[0]
    storage = first.storage
    count, slots = len(layers), flat["keys"].shape[1]  # slots per layer, its scratch slot included
    batch, heads, capacity = storage.batch, storage.heads, storage.capacity
    fields = {name: first.storage.fields[name] for name in flat}
    grids = {name: tensor[:, :-1].view(count, batch, heads, capacity, *fields[name].trailing)
             for name, tensor in flat.items()}  # fmt: skip
    type(first.scorer).flush_together(layers, grids)
    longest = first.longest
    size = first.options.size
    importance = type(first.scorer).importance_together(layers, grids, longest)
    positions = grids["positions"][..., :longest]
    pads = first.pads_device[:, None, None] if first.pads.any() else 0  # (each row's sinks follow its padding)
    priority = protect(importance, positions, first.seen, size.sink_tokens, size.recent_tokens, pads)
    victims = lowest(priority, torch.ones((), dtype=torch.bool, device=storage.device), eviction.most)
    lengths = torch.full((), longest, dtype=victims.dtype, device=storage.device)
    drops = torch.from_numpy(eviction.drops).to(storage.device)
    tail, targets, lanes = removal_moves(victims, lengths, drops)
    # Flat slots of the stacked storages: layer l's segment (b, h) starts at l * slots + starts[b, h]; lanes that do
    # not move write each layer's scratch slot.
    layer_starts = torch.arange(count, device=storage.device).view(count, 1, 1, 1) * slots
    starts = layer_starts + storage.starts[..., None]
    scratch = layer_starts + (slots - 1)
    source = torch.where(lanes, starts + tail, scratch).flatten()
    target = torch.where(lanes, starts + targets, scratch).flatten()
    for name, tensor in flat.items():
        whole = tensor.reshape(count * slots, *fields[name].trailing)  # (a view: the slices are consecutive)
        whole.index_copy_(0, target, whole.index_select(0, source))
    prepared = _prepare(layers, grids, int(eviction.keep.min()))
    for layer in layers:
        layer.storage.set_lengths(eviction.keep)
        layer.evicted_together(eviction, prepared)


def _prepare(layers: list[CompressedLayer], grids: dict[str, torch.Tensor], start: int) -> int | None:
    """Write the position and score 0 of the next ``eviction_interval`` tokens into the slots from ``start`` of every
    layer's segments (``CompressedLayer`` prepares alike alone); returns the first slot not prepared, or None."""
    first = layers[0]
    room = min(first.policy.interval, first.storage.capacity - start)
    if room <= 0 or first.padding_held:
        return None
    seen = first.seen
    grids["positions"].narrow(3, start, room).copy_(
        torch.arange(seen, seen + room, dtype=torch.int32, device=grids["positions"].device)
    )
    for name in ("scores", "biases"):
        if name in grids:
            grids[name].narrow(3, start, room).fill_(0.0)
    return start + room
