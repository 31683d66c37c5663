"""One layer's stored entries: every row's and KV head's keys and values (plain or coded) and their bookkeeping.

Each (row, KV head) owns a *segment* of slots whose first ``length`` slots hold its entries, in any order (each
entry carries its position). The segments lie one after another in one flat tensor per field, ``[slots, ...]``,
followed by one scratch slot that absorbs the writes of masked-out lanes. When every segment has the same
capacity (every allocation but "heads"), the flat tensors are the ``[batch, kv_heads, capacity, ...]`` layout of
transformers' cache layers and a read is a view; under ``allocation="heads"`` each KV head has a capacity of its
own, and the memory a head does not keep is not held.

Lengths are known on the host (``lengths_host``, a NumPy array, exact, so that no decision reads the device) and on
the device (``lengths``, sharing the host's memory on a CPU).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from decodekit.cache import _native


@dataclass(frozen=True)
class Field:
    """What one kind of entry holds per slot: a trailing shape (``()`` for one number) and a dtype."""

    trailing: tuple[int, ...]
    dtype: torch.dtype


# Where a layout's tensors come from: ``allocate(name, shape, dtype, device)`` gives a zeroed tensor (a slice of one
# shared by several layers' storages, ``joint.LayerGroup``); by default each storage makes its own.
Allocate = Callable[[str, tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def own_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new zeroed tensor of the storage's own (the default ``Allocate``)."""
    return torch.zeros(shape, dtype=dtype, device=device)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> dict[tuple[str, int], int]:
    """The storages behind ``tensors``, keyed by (device, address) so that one shared by several views
    counts once, with their sizes in bytes.

    Example:
        >>> base = torch.zeros(10)
        >>> storage_bytes([base, base[:3], torch.ones(2, dtype=torch.int8)]).values()
        dict_values([40, 2])
    """
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return storages


def mark_static(tensor: torch.Tensor | None) -> None:
    """Tell ``torch.compile`` that a CUDA ``tensor`` kept across decoding steps keeps its address, so that CUDA graphs
    may capture steps that write into it. Outside compiled steps only; nothing to do off CUDA."""
    if tensor is not None and tensor.is_cuda and not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)


class EntryStorage:
    """The entries of one cache layer: a segment of slots per (row, KV head), each with its own length.

    Args:
        fields: what each slot holds, by name (keys, values or their codes and group scales, positions, scores...).
        batch, heads: rows and KV heads.
        capacity: slots per segment to start with.
        device: where the tensors live.

    Example:
        >>> storage = EntryStorage({"keys": Field((2,), torch.float32)}, batch=1, heads=2, capacity=4, device="cpu")
        >>> storage.append({"keys": torch.arange(12.0).view(1, 2, 3, 2)}, 3)
        >>> storage.read("keys")[0, 1].tolist()
        [[6.0, 7.0], [8.0, 9.0], [10.0, 11.0]]
        >>> storage.keep(torch.tensor([[[2, 0], [1, 2]]]), 2)
        >>> storage.read("keys")[0, 1].tolist(), storage.lengths_host.tolist()
        ([[8.0, 9.0], [10.0, 11.0]], [[2, 2]])
    """

    def __init__(
        self, fields: dict[str, Field], batch: int, heads: int, capacity: int, device: torch.device | str
    ) -> None:
        self.fields = dict(fields)
        self.batch, self.heads = batch, heads
        self.device = torch.device(device)
        # Counted up at every change of the lengths or the layout: a plan made for a state holds while it is unchanged.
        self.version = 0
        self._set_host_lengths(np.zeros((batch, heads), dtype=np.int64))
        self._lay_out(np.full((batch, heads), capacity, dtype=np.int64), None)

    def __deepcopy__(self, memo: dict) -> EntryStorage:
        """A deep copy whose device lengths share its own host lengths' memory again (on a CPU)."""
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        for name, value in vars(self).items():
            if name not in ("_views", "_slices", "_step_views", "_padded"):
                setattr(copied, name, copy.deepcopy(value, memo))
        copied._views, copied._slices, copied._step_views, copied._padded = {}, {}, {}, None
        if self.device.type == "cpu":
            copied.lengths = torch.from_numpy(copied._lengths_host)
        return copied

    def _set_host_lengths(self, lengths: np.ndarray) -> None:
        """Hold ``lengths`` as the host's lengths, and the device's (a view of them on a CPU)."""
        self._lengths_host = lengths
        self._count_change()
        host = torch.from_numpy(lengths)
        self._on_cpu = self.device.type == "cpu"
        self.lengths = host if self._on_cpu else host.to(self.device)
        self._length_range = (int(lengths.min()), int(lengths.max())) if lengths.size else (0, 0)
        self._free: int | None = None  # the fewest free slots of any segment, once counted
        self._stale = False  # whether compiled steps changed the device's lengths since the host last read them

    def _count_change(self) -> None:
        """Count a change of the lengths or the layout (``version``), outside compiled steps: a compiled step's
        changes end every plan of eager steps (``CompressedLayer.mark_host_stale``), and a count the compiler read
        would be a guard that fails at every step."""
        if not torch.compiler.is_compiling():
            self.version += 1

    def mark_stale(self) -> None:
        """Note that the device's lengths changed without the host (a compiled step): read them back when next
        needed."""
        self._stale = True
        self._free = None
        self._count_change()

    def lengths_set_in_place(self, length_range: tuple[int, int], free: int) -> None:
        """Note that an operator set the lengths in place on a CPU (the host's array is the device's memory), to ones
        whose least and most are ``length_range`` and whose fewest free slots are ``free``, as the caller knows."""
        self._length_range, self._free = length_range, free
        self._count_change()

    def _refresh(self) -> None:
        if self._stale:
            self._stale = False
            if self.device.type != "cpu":  # (on a CPU the host's array is the device's memory)
                self._lengths_host[...] = self.lengths.cpu().numpy()
            self._length_range = (int(self._lengths_host.min()), int(self._lengths_host.max()))

    @property
    def lengths_host(self) -> np.ndarray:
        """Host ``[batch, heads]``: each segment's entries."""
        self._refresh()
        return self._lengths_host

    @property
    def length_range(self) -> tuple[int, int]:
        """The least and most entries of any segment."""
        self._refresh()
        return self._length_range

    # -- layout -------------------------------------------------------------------------------------------------

    def _lay_out(self, capacities: np.ndarray, source: torch.Tensor | None, allocate: Allocate = own_tensor) -> None:
        """Give each segment ``capacities[b, h]`` slots (host ``[batch, heads]``), copying each segment's entries
        from segment ``source[b, h]`` of the old layout (a flat index of old segments; None: nothing to copy); the new
        tensors come from ``allocate``."""
        old = getattr(self, "flat", None)
        old_starts = getattr(self, "starts", None)
        self._count_change()
        self.capacities = np.array(capacities, dtype=np.int64)
        self._free = None
        ends = self.capacities.reshape(-1).cumsum()
        starts_host = (ends - self.capacities.reshape(-1)).reshape(self.batch, self.heads)
        self.starts = torch.from_numpy(starts_host).to(self.device)
        total = int(ends[-1]) if ends.size else 0
        least, most = int(self.capacities.min()), int(self.capacities.max())
        self.rectangular = least == most  # (starts then are canonical: segments laid out in order)
        self.capacity = most  # the widest segment
        self.least_capacity = least
        self.flat = {name: allocate(name, (total + 1, *field.trailing), field.dtype, self.device)
                     for name, field in self.fields.items()}  # fmt: skip
        self._views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name: (its flat tensor, the view of it)
        self._slices: dict[tuple[str, int, int], torch.Tensor] = {}  # (name, first slot, slots): ``slots``' view
        self._step_views: dict[int, tuple[torch.Tensor, ...]] = {}  # slot: ``append_step``'s views
        self._padded: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (starts, stop, padded_index(stop))
        if old is None or source is None:
            return
        longest = self.length_range[1]
        if longest == 0:
            return
        if _native.runs_on(self.device):  # (each segment's entries copied as one block, every field at once)
            _native.copy_segments([old[name] for name in self.flat], list(self.flat.values()), old_starts, source,
                                  self.starts, self.lengths)  # fmt: skip
            return
        slots = torch.arange(longest, device=self.device)
        from_index = old_starts.flatten()[source.flatten()].view(self.batch, self.heads, 1) + slots
        valid = slots < self.lengths[..., None]
        scratch = total
        to_index = torch.where(valid, self.starts[..., None] + slots, scratch)
        from_index = torch.where(valid, from_index, next(iter(old.values())).shape[0] - 1)
        for name, tensor in self.flat.items():
            tensor.index_copy_(0, to_index.flatten(), old[name].index_select(0, from_index.flatten()))

    def reserve(self, capacities: np.ndarray | int, room: int = 0, allocate: Allocate = own_tensor) -> None:
        """Make each segment hold at least ``capacities`` slots (an int for all, or host ``[batch, heads]``),
        keeping its entries; a segment that must grow gets ``room`` slots more (in tensors from ``allocate``).
        Nothing moves where every segment is large enough; a rectangular layout stays rectangular."""
        wanted = np.broadcast_to(np.asarray(capacities, dtype=np.int64), (self.batch, self.heads))
        if (wanted <= self.capacities).all():
            return
        grown = np.where(wanted > self.capacities, wanted + room, self.capacities)
        if self.rectangular:
            grown = np.full_like(grown, grown.max())
        self._lay_out(grown, self._own_segments(), allocate)

    def resize(self, capacities: np.ndarray | int, allocate: Allocate = own_tensor) -> None:
        """Give each segment exactly ``capacities`` slots (at least its length), keeping its entries (in tensors from
        ``allocate``)."""
        wanted = np.broadcast_to(np.asarray(capacities, dtype=np.int64), (self.batch, self.heads))
        if (wanted < self.lengths_host).any():
            raise ValueError("a segment cannot be resized below its length")
        if np.array_equal(wanted, self.capacities):
            return
        self._lay_out(wanted, self._own_segments(), allocate)

    def _own_segments(self) -> torch.Tensor:
        return torch.arange(self.batch * self.heads, device=self.device).view(self.batch, self.heads)

    # -- lengths ------------------------------------------------------------------------------------------------

    def set_lengths(self, lengths: np.ndarray | int) -> None:
        """Set every segment's length (host ``[batch, heads]`` or one int); the slots past it are free."""
        self._refresh()
        self._lengths_host[...] = lengths
        self._count_change()
        self._length_range = (int(self._lengths_host.min()), int(self._lengths_host.max()))
        self._free = None
        if self.device.type != "cpu":
            self.lengths.copy_(torch.from_numpy(self._lengths_host), non_blocking=True)

    def _add_to_lengths(self, count: int) -> None:
        least, most = self.length_range
        self._lengths_host += count
        self._count_change()
        if not self._on_cpu:
            self.lengths += count
        self._length_range = (least + count, most + count)
        if self._free is not None:
            self._free -= count

    @property
    def free_slots(self) -> int:
        """The fewest free slots (capacity less length) of any segment."""
        if self._free is None:
            self._free = int((self.capacities - self.lengths_host).min()) if self.capacities.size else 0
        return self._free

    @property
    def equal_lengths(self) -> bool:
        """Whether every segment holds the same number of entries."""
        return self.length_range[0] == self.length_range[1]

    # -- reads --------------------------------------------------------------------------------------------------

    def tensor(self, name: str) -> torch.Tensor:
        """Field ``name`` as ``[batch, heads, capacity, ...]`` (rectangular layouts only): a view of the storage."""
        if not self.rectangular:
            raise ValueError("only a rectangular storage has a [batch, heads, capacity] view")
        flat = self.flat[name]
        if torch.compiler.is_compiling():
            return flat[:-1].view(self.batch, self.heads, self.capacity, *self.fields[name].trailing)
        made = self._views.get(name)  # (an eager step reads each field's view several times: made once per layout)
        if made is None or made[0] is not flat:
            self._slices.clear()  # (views of the tensor replaced)
            made = self._views[name] = (flat, flat[:-1].view(self.batch, self.heads, self.capacity,
                                                             *self.fields[name].trailing))  # fmt: skip
        return made[1]

    def slots(self, name: str, start: int, count: int) -> torch.Tensor:
        """Field ``name`` of each segment's ``count`` slots from ``start``, ``[batch, heads, count, ...]``: a view
        (rectangular layouts only). Eager steps between evictions read and write the same slots again and again:
        each view is made once per layout.

        Example:
            >>> storage = EntryStorage({"scores": Field((), torch.float32)}, batch=1, heads=2, capacity=4, device="cpu")
            >>> storage.slots("scores", 1, 2).fill_(1.0).shape, storage.tensor("scores")[0, 0].tolist()
            (torch.Size([1, 2, 2]), [0.0, 1.0, 1.0, 0.0])
        """
        whole = self.tensor(name)
        if torch.compiler.is_compiling():
            return whole.narrow(2, start, count)
        key = (name, start, count)
        view = self._slices.get(key)
        if view is None:
            if len(self._slices) >= 256:
                self._slices.clear()
            view = self._slices[key] = whole.narrow(2, start, count)
        return view

    def read(self, name: str, stop: int | None = None) -> torch.Tensor:
        """Field ``name`` of each segment's first ``stop`` slots (default: the longest length), ``[batch, heads,
        stop, ...]``: a view in a rectangular layout (``stop`` at most the capacity), else a copy whose slots past a
        segment's capacity hold another segment's entries (a length mask hides them)."""
        stop = self.length_range[1] if stop is None else stop
        if self.rectangular and stop <= self.capacity:
            return self.slots(name, 0, stop)
        return self.flat[name].index_select(0, self.padded_index(stop).flatten()).view(
            self.batch, self.heads, stop, *self.fields[name].trailing
        )

    def padded_index(self, stop: int) -> torch.Tensor:
        """``[batch, heads, stop]``: the flat slot of each segment's first ``stop`` slots (kept inside the storage;
        made once per layout and ``stop``, not to be written to)."""
        made = self._padded
        if made is not None and made[0] is self.starts and made[1] == stop:
            return made[2]
        index = self.starts[..., None] + torch.arange(stop, device=self.device)
        index = index.clamp_(max=self.flat_slots - 1)
        if not torch.compiler.is_compiling():
            self._padded = (self.starts, stop, index)
        return index

    def read_many(self, names: Iterable[str], stop: int) -> dict[str, torch.Tensor]:
        """``read`` of several fields, the segments' slots found once for all of them."""
        if self.reads_views(stop):
            return {name: self.read(name, stop) for name in names}
        index = self.padded_index(stop).flatten()
        return {name: self.flat[name].index_select(0, index).view(self.batch, self.heads, stop,
                                                                    *self.fields[name].trailing)
                for name in names}  # fmt: skip

    @property
    def flat_slots(self) -> int:
        """Slots in all (the scratch slot left out)."""
        return next(iter(self.flat.values())).shape[0] - 1

    def take(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """Field ``name`` at each segment's ``slots`` (``[batch, heads, n]``): ``[batch, heads, n, ...]``."""
        index = (self.starts[..., None] + slots).flatten()
        return self.flat[name].index_select(0, index).view(*slots.shape, *self.fields[name].trailing)

    def valid(self, stop: int, extra: int = 0) -> torch.Tensor:
        """``[batch, heads, stop]``: True for the slots that hold an entry (``extra``: and that many after each
        segment's length, such as a pass's own new entries)."""
        return torch.arange(stop, device=self.device) < (self.lengths[..., None] + extra)

    # -- writes -------------------------------------------------------------------------------------------------

    def append(
        self,
        entries: dict[str, torch.Tensor | float | bool],
        count: int,
        room: int = 0,
        allocate: Allocate = own_tensor,
    ) -> None:
        """Write ``count`` new entries after each segment's stored ones (``entries[name]``: ``[batch, heads, count,
        ...]``, or one value for all), growing segments that lack room (by ``room`` more slots, in tensors from
        ``allocate``), and count them."""
        if self.free_slots < count:
            self.reserve(self.lengths_host + count, room, allocate)
        least, most = self.length_range
        if self.rectangular and least == most:
            for name, entry in entries.items():
                target = self.slots(name, least, count)
                target.copy_(entry) if isinstance(entry, torch.Tensor) else target.fill_(entry)
        elif _native.runs_on(self.device) and all(isinstance(entry, torch.Tensor) or entry == 0
                                                 for entry in entries.values()):
            full = (self.batch, self.heads, count)
            named = [(name, self._as_field(name, entry, full)) for name, entry in entries.items()
                     if isinstance(entry, torch.Tensor)]  # fmt: skip
            zeroed = [self.flat[name] for name, entry in entries.items() if not isinstance(entry, torch.Tensor)]
            _native.append_rows([self.flat[name] for name, _ in named], [entry for _, entry in named], zeroed,
                                self.starts, self.lengths, count)  # fmt: skip
        else:
            index = (self.starts + self.lengths)[..., None] + torch.arange(count, device=self.device)
            self.write_at(index.flatten(), entries, count)
        self._add_to_lengths(count)

    def append_step(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a decoding step's ``keys`` and ``values`` (``[batch, heads, 1, head_dim]``) into the next slot of every
        segment and count them; return fields ``keys`` and ``values`` through the new entries, as attention reads them
        (views). For a rectangular layout whose segments hold one length and have a free slot; the step's other
        fields are left as they are (written before: ``CompressedLayer`` prepares the next steps' positions and
        scores). Eager steps between evictions write the same slots again and again: each slot's views are made once
        per layout.

        Example:
            >>> fields = {"keys": Field((2,), torch.float32), "values": Field((2,), torch.float32)}
            >>> storage = EntryStorage(fields, batch=1, heads=1, capacity=4, device="cpu")
            >>> keys, values = storage.append_step(torch.ones(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
            >>> keys.shape, storage.lengths_host.tolist()
            (torch.Size([1, 1, 1, 2]), [[1]])
        """
        if not self.takes_step():
            raise ValueError("append_step needs a rectangular layout whose segments hold one length and have room")
        slot = self.length_range[0]
        made = self._step_views.get(slot)  # (emptied with every new layout: ``_lay_out``)
        if made is None:
            if len(self._step_views) >= 256:
                self._step_views.clear()
            made = self._step_views[slot] = (
                self.slots("keys", slot, 1), self.slots("values", slot, 1),
                self.slots("keys", 0, slot + 1), self.slots("values", 0, slot + 1),
            )  # fmt: skip
        made[0].copy_(keys)
        made[1].copy_(values)
        self._add_to_lengths(1)
        return made[2], made[3]

    def takes_step(self) -> bool:
        """Whether ``append_step`` can write the next step: a rectangular layout whose segments hold one length and
        each have a free slot."""
        least, most = self.length_range
        return least == most and self.rectangular and self.free_slots > 0

    def append_coded(
        self, parts: list[tuple[str, torch.Tensor, int]], group_size: int, position: int,
        others: dict[str, torch.Tensor | float],
    ) -> None:
        """One decoding step's entry after each segment's (on a CPU, with the C++ operators: ``_native.append_coded``):
        for each ``(name, rows, bits)`` of ``parts`` (``rows`` float32 ``[batch, heads, 1, head_dim]``), the codes in
        field ``name``, its group scales and offsets in ``{name[:-1]}_scales`` and ``{name[:-1]}_offsets``; the
        ``positions`` field set to ``position``; each field of ``others`` given its ``[batch, heads, 1]`` values or
        zero (``0.0``), the fields left unnamed untouched; the entry counted. Every segment must have a free slot
        (``reserve``)."""
        if self.free_slots < 1:
            raise ValueError("append_coded needs a free slot in every segment: reserve one first")
        flat = self.flat
        coded = []
        for name, _, _ in parts:
            prefix = name[:-1]
            coded += [flat[name], flat[f"{prefix}_scales"], flat[f"{prefix}_offsets"]]
        written, values, zeroed = [], [], []
        for name, value in others.items():
            if isinstance(value, torch.Tensor):
                written.append(flat[name])
                values.append(self._as_field(name, value, (self.batch, self.heads, 1)))
            elif value == 0:
                zeroed.append(flat[name])
            else:
                raise ValueError(f"append_coded writes a field's values or zero; got {value!r} for {name!r}")
        _native.append_coded(coded, [rows for _, rows, _ in parts], [bits for _, _, bits in parts], group_size,
                             flat["positions"], position, written, values, zeroed, self.starts, self.lengths,
                             torch.from_numpy(self.capacities))  # fmt: skip
        self._add_to_lengths(1)

    def _as_field(self, name: str, entry: torch.Tensor, full: tuple[int, int, int]) -> torch.Tensor:
        """``entry`` in field ``name``'s dtype, expanded to ``full`` (``[batch, heads, count]``) and its trailing
        shape."""
        field = self.fields[name]
        if entry.dtype != field.dtype:
            entry = entry.to(field.dtype)
        if tuple(entry.shape[:3]) != full:
            entry = entry.expand(*full, *field.trailing)
        return entry

    def write_at(self, flat_index: torch.Tensor, entries: dict[str, torch.Tensor | float | bool], count: int) -> None:
        """Write ``entries`` (each ``[batch, heads, count, ...]`` or one value) at the flat slots ``flat_index``."""
        full = (self.batch, self.heads, count)
        native = _native.runs_on(self.device)
        targets, rows = [], []  # (with the C++ operator: every field's rows written at once)
        for name, entry in entries.items():
            field = self.fields[name]
            if not isinstance(entry, torch.Tensor):
                self.flat[name].index_fill_(0, flat_index, entry)
                continue
            entry = self._as_field(name, entry, full)
            if native:  # (any shape: the operator reads the rows' bytes in order)
                targets.append(self.flat[name])
                rows.append(entry)
            else:
                self.flat[name].index_copy_(0, flat_index, entry.reshape(-1, *field.trailing))
        if targets:
            _native.write_rows(targets, flat_index, rows)

    def write_slots(
        self,
        slots: torch.Tensor,
        entries: dict[str, torch.Tensor | float | bool],
        lanes: torch.Tensor | None = None,
    ) -> None:
        """Write ``entries`` (``[batch, heads, n, ...]`` or one value) at each segment's ``slots`` (``[batch, heads,
        n]``), only where ``lanes`` (``[batch, heads, n]``) is True when given; the lengths stay."""
        index = self.starts[..., None] + slots
        if lanes is not None:
            index = torch.where(lanes, index, self.flat_slots)
        self.write_at(index.flatten(), entries, slots.shape[-1])

    def move(
        self,
        sources: torch.Tensor,
        targets: torch.Tensor,
        lanes: torch.Tensor | None = None,
        names: Iterable[str] | None = None,
    ) -> None:
        """Within each segment, copy the entries at slots ``sources`` to slots ``targets`` (both ``[batch, heads,
        n]``), all read before any is written; ``lanes`` (``[batch, heads, n]``, bool): only where True (the others
        touch the scratch slot alone)."""
        tensors = [self.flat[name] for name in (self.fields if names is None else names)]
        if _native.runs_on(self.device):
            _native.move_in_segments(tensors, self.starts, sources, targets, lanes)
            return
        starts = self.starts[..., None]
        source, target = starts + sources, starts + targets
        if lanes is not None:
            scratch = torch.full((), self.flat_slots, dtype=source.dtype, device=self.device)
            source, target = torch.where(lanes, source, scratch), torch.where(lanes, target, scratch)
        self._copy_rows(tensors, source.flatten(), target.flatten())

    def _copy_rows(self, tensors: list[torch.Tensor], source: torch.Tensor, target: torch.Tensor) -> None:
        """In each of ``tensors``, copy the flat slots ``source`` to ``target``, all read before any is written."""
        if _native.runs_on(self.device):
            _native.copy_rows(tensors, source, target)
            return
        for tensor in tensors:
            tensor.index_copy_(0, target, tensor.index_select(0, source))

    def keep(self, slots: torch.Tensor, counts: np.ndarray | int) -> None:
        """Keep each segment's entries at ``slots`` (``[batch, heads, n]``), moved to its first slots in that
        order; ``counts`` (host ``[batch, heads]``, or one int) of them in each segment, the others dropped."""
        count = slots.shape[-1]
        starts = self.starts[..., None]
        place = torch.arange(count, device=self.device)
        source, target = starts + slots, starts + place
        if not isinstance(counts, int):  # lanes past a segment's count write the scratch slot
            kept = torch.from_numpy(np.ascontiguousarray(counts)).to(self.device)[..., None]
            source = torch.where(place < kept, source, self.flat_slots)
            target = torch.where(place < kept, target, self.flat_slots)
        self._copy_rows(list(self.flat.values()), source.flatten(), target.flatten())
        self.set_lengths(counts)

    def reads_views(self, stop: int) -> bool:
        """Whether ``read`` of the first ``stop`` slots gives a view of the storage (written in place) or a copy."""
        return self.rectangular and stop <= self.capacity

    def write_prefix(self, name: str, values: torch.Tensor) -> None:
        """Write ``values`` (``[batch, heads, stop, ...]``) into field ``name`` of each segment's first ``stop`` slots
        (only the slots that hold entries, in a segmented layout)."""
        stop = values.shape[2]
        if self.reads_views(stop):
            self.tensor(name)[:, :, :stop].copy_(values)
            return
        index = torch.where(self.valid(stop), self.padded_index(stop), self.flat_slots)
        self.flat[name].index_copy_(0, index.flatten(), values.reshape(-1, *self.fields[name].trailing))

    def decay_add(self, name: str, added: torch.Tensor, decay: float) -> None:
        """Field ``name`` (float32) of each segment's first ``added.shape[-1]`` slots that hold entries: times
        ``decay``, plus ``added`` (``[batch, heads, stop]``)."""
        stop = added.shape[-1]
        if _native.runs_on(self.device):
            _native.decay_add(self.flat[name], self.starts, self.lengths, added, decay)
            return
        values = self.read(name, stop)
        values.mul_(decay).add_(added)
        if not self.reads_views(stop):
            self.write_prefix(name, values)

    def truncate(self, count: int) -> None:
        """Forget each segment's last ``count`` entries (the ones a pass just appended)."""
        self._add_to_lengths(-count)

    # -- rows -----------------------------------------------------------------------------------------------------

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` (a 1-d index, repeats allowed) in that order: beam reorders, repeats, selections."""
        rows_host = rows.to("cpu", torch.long).numpy()
        source = torch.from_numpy(rows_host[:, None] * self.heads + np.arange(self.heads)).to(self.device)
        capacities = self.capacities[rows_host]
        self.batch = rows_host.size
        self._set_host_lengths(self.lengths_host[rows_host].copy())
        self._lay_out(capacities, source)

    # -- state ----------------------------------------------------------------------------------------------------

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The storage as tensors (every field's flat tensor, each segment's capacity and length) and numbers, to be
        saved (``persist.py``) and given back to ``from_state``."""
        tensors = {f"field.{name}": tensor for name, tensor in self.flat.items()}
        tensors["capacities"] = torch.from_numpy(self.capacities.copy())
        tensors["lengths"] = torch.from_numpy(self.lengths_host.copy())
        return tensors, {"batch": self.batch, "heads": self.heads}

    @classmethod
    def from_state(
        cls, fields: dict[str, Field], tensors: dict[str, torch.Tensor], numbers: dict, device: torch.device | str
    ) -> EntryStorage:
        """A storage holding what ``state`` gave, on ``device``; ValueError where the tensors do not fit ``fields``."""
        storage = cls(fields, numbers["batch"], numbers["heads"], 0, device)
        capacities = tensors["capacities"].numpy().astype(np.int64)
        storage._set_host_lengths(tensors["lengths"].numpy().astype(np.int64).copy())
        storage._lay_out(capacities, None)
        for name, field in fields.items():
            held = tensors.get(f"field.{name}")
            if held is None or held.dtype != field.dtype or tuple(held.shape) != tuple(storage.flat[name].shape):
                raise ValueError(f"the saved storage's field {name!r} does not fit this cache's layout")
            storage.flat[name].copy_(held)
        return storage

    # -- size -----------------------------------------------------------------------------------------------------

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor the storage holds on its device."""
        return [*self.flat.values(), self.starts, self.lengths]
