"""How a compressed cache layer stores its entries: keys and values (exact, in 16 bits, or quantized with
the recent tokens' exact copies beside them), and the per-entry bookkeeping, with reserved room so that
decoding steps between evictions copy one entry each.

Entries are ``[batch, kv_heads, slots, ...]``. ``EntryStorage`` is a mixin of ``CompressedLayer``; the
attributes it works on are set up in ``CompressedLayer.__init__``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch

from decodekit.cache.quantize import Quantizer
from decodekit.cache.quantize import rotate as turn
from decodekit.cache.size import reserved_room

# The per-entry tensors, [batch, kv_heads, slots, ...], as stored: the bookkeeping ones are behind the properties
# ``scores``, ``value_norms``, ``positions``, ``live`` and ``biases``, which bring them up to date first. A layer keeps
# value norms only where eviction ranks by them, and log-mass biases only where its prompt's kept entries are refit
# (``CompressedLayer.bookkeeping``; ``matching.py``).
BOOKKEEPING = ("_scores", "_value_norms", "_positions", "_live", "_biases")
BIAS_DTYPE = torch.float16  # a refit entry's log-mass bias: 2 bytes (``size.BIAS_BYTES``)
# With quantized storage, each entry's group scales and offsets (see ``Quantizer``).
CODING = ("key_scales", "key_offsets", "value_scales", "value_offsets")
PARTS = ("keys", "values")
# Per row, with quantized storage: the ring of exact recent entries.
EXACT = ("recent_keys", "recent_values")


def storage_bytes(tensors: Iterable[torch.Tensor]) -> dict[tuple[str, int], int]:
    """The storages behind ``tensors``, keyed by (device, address) so that one shared by several views
    (or several layers) counts once, with their sizes in bytes.

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


def positions_from(start: int | torch.Tensor, count: int, device: torch.device, dtype=torch.long) -> torch.Tensor:
    """``count`` consecutive positions from ``start``: a number, or a 0-d tensor (the tokens seen, counted on the
    device in a compiled step: ``CompressedLayer._seen_now``).

    Example:
        >>> positions_from(5, 3, torch.device("cpu")).tolist(), positions_from(torch.tensor(5), 2, "cpu").tolist()
        ([5, 6, 7], [5, 6])
    """
    if isinstance(start, torch.Tensor):
        return torch.arange(count, device=device, dtype=dtype) + start.to(dtype)
    return torch.arange(start, start + count, device=device, dtype=dtype)


def scatter_position(positions: torch.Tensor, slot: torch.Tensor, position: int | torch.Tensor) -> torch.Tensor:
    """``positions`` with ``position`` (a number or a 0-d tensor) written at ``slot`` along dimension 2, out of place.

    Example:
        >>> scatter_position(torch.zeros(1, 1, 3, dtype=torch.int32), torch.tensor([[[1]]]), torch.tensor(7)).tolist()
        [[[0, 7, 0]]]
    """
    if isinstance(position, torch.Tensor):
        return positions.scatter(2, slot, position.to(positions.dtype).expand(slot.shape))
    return positions.scatter(2, slot, position)


def mark_static(tensor: torch.Tensor | None) -> None:
    """Tell ``torch.compile`` that a CUDA ``tensor`` the cache keeps across decoding steps keeps its address, so that
    CUDA graphs (``mode="reduce-overhead"``) may capture steps that write into it (a graph is recorded again
    where its address changes). Placed outside compiled steps only; nothing to do off CUDA."""
    if tensor is not None and tensor.is_cuda and not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)


def _views_from_start(tensor: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``tensor`` starts where ``base`` does: a view of it from its start (a tensor that replaced the view
    is another allocation, which cannot start inside ``base`` while ``base`` lives). Unlike ``_base``, this holds
    in a deep copy of the cache, whose views share the copied storages. (Eager only: ``torch.compile`` cannot trace
    a comparison of data pointers.)"""
    return tensor.data_ptr() == base.data_ptr()


def slot_rows(index: torch.Tensor, slots: int) -> torch.Tensor:
    """``index`` (``[*lead, n]``, slots below ``slots``) as the row numbers of those entries in a tensor of
    ``[*lead, slots, ...]`` entries seen as ``[rows * slots, width]``: ``[rows * n]``, for ``take_slots``."""
    count = index.shape[-1]
    rows = index.numel() // count if count else 0
    offsets = torch.arange(0, rows * slots, slots, device=index.device)
    return (index.reshape(rows, count) + offsets[:, None]).reshape(-1)


def take_slots(tensor: torch.Tensor, index: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The entries of ``tensor`` (``[*lead, slots, *trailing]``) at ``index`` (``[*lead, n]``, each below ``slots``)
    along its slots dimension: ``[*lead, n, *trailing]``, as a ``gather`` would give them. ``rows`` is
    ``slot_rows(index, slots)``, when already made for another tensor of the same slots.

    Each entry is copied whole, as a row of the tensor seen as ``[rows * slots, width]``; on a CPU, a ``gather``
    over an expanded index copies element by element, several times slower.

    Example:
        >>> take_slots(torch.arange(12).view(2, 3, 2), torch.tensor([[2, 0], [1, 1]])).tolist()
        [[[4, 5], [0, 1]], [[8, 9], [8, 9]]]
    """
    lead, count = index.shape[:-1], index.shape[-1]
    slots, trailing = tensor.shape[len(lead)], tensor.shape[len(lead) + 1 :]
    if count == 0 or tensor.numel() == 0:
        return tensor.new_empty((*lead, count, *trailing))
    if rows is None:
        rows = slot_rows(index, slots)
    return tensor.reshape(rows.numel() // count * slots, -1).index_select(0, rows).view(*lead, count, *trailing)


def move_tail_into(tensor: torch.Tensor, dim: int, start: int, rows: torch.Tensor) -> None:
    """Move the ``n`` entries from slot ``start`` on of a contiguous ``tensor`` (``[*lead, slots, *trailing]``, its
    slots along ``dim``) into the slots ``rows`` names (``slot_rows`` of an ``[*lead, n]`` index over all its
    ``slots``), in place: the entry in slot ``start + j`` of each row goes to that row's ``j``-th slot. An eviction
    whose ``n`` victims all sit before ``start`` and whose ``n`` entries after it all stay fills the victims' slots so,
    moving ``n`` entries per row instead of every kept one.

    Example:
        >>> slots = torch.arange(12.0).view(2, 6)  # 5 stored: each row keeps 3, slots 3 and 4 go where 2 went
        >>> move_tail_into(slots, 1, 3, slot_rows(torch.tensor([[0, 2], [1, 0]]), 6))
        >>> slots[:, :3].tolist()
        [[3.0, 1.0, 4.0], [10.0, 9.0, 8.0]]
    """
    count = rows.numel() // tensor.shape[:dim].numel()
    tail = tensor.narrow(dim, start, count).clone(memory_format=torch.contiguous_format)
    entries = tensor.view(tensor.shape[: dim + 1].numel(), -1)  # (a view: the writes land in ``tensor``)
    entries.index_copy_(0, rows, tail.view(rows.numel(), -1))


def prepare_room(spare: dict[str, torch.Tensor], dim: int, filled: int, next_position: int | torch.Tensor) -> None:
    """Give the spare room's entries (slots along ``dim`` of each tensor in ``spare``), from slot ``filled`` on,
    what the next tokens will have: live, score 0, consecutive positions from ``next_position``. Their keys,
    values and value norms come with them (``_append_to_prepared_room``, ``_score_pending``)."""
    room = spare["keys"].shape[dim] - filled
    if room <= 0:
        return
    if "_live" in spare:  # (left out by a caller whose room is live already)
        spare["_live"].narrow(dim, filled, room).fill_(True)
    spare["_scores"].narrow(dim, filled, room).zero_()
    if "_biases" in spare:  # the next tokens are new entries: no bias
        spare["_biases"].narrow(dim, filled, room).zero_()
    positions = positions_from(next_position, room, spare["keys"].device, torch.int32)
    spare["_positions"].narrow(dim, filled, room).copy_(positions)


def decoded_part(
    part: str,
    quantizer: Quantizer | None,
    stored: Callable[[str], torch.Tensor],
    dtype: torch.dtype,
    *,
    turned: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``part`` ("keys" or "values") of stored entries decoded to ``dtype``, in a new tensor or into ``out`` (a
    tensor of that shape and dtype, or a view of one; the ring's exact entries are written into it afterwards):
    ``stored(name)`` gives the stored tensor of that name (the part, and with a ``Quantizer`` its ``CODING``
    scales and offsets); without one, the part is held as it is, in 16 bits or the model's dtype.
    ``turned``: coded keys are left turned, as a layer that ``reads_turned_keys`` reads them."""
    if quantizer is None:
        return stored(part).to(dtype, copy=True) if out is None else out.copy_(stored(part))
    prefix = part[:-1]
    coded = {"codes": stored(part), "scales": stored(f"{prefix}_scales"), "offsets": stored(f"{prefix}_offsets")}
    return quantizer.decode(coded, dtype, turn_back=not turned, out=out)


def write_slots(target: torch.Tensor, slots: torch.Tensor, entry: torch.Tensor | float | bool) -> None:
    """Write ``entry`` into each row and head's ``slots`` of ``target`` (``[batch, kv_heads, slots, ...]``):
    ``target[b, h, slots[b, h, i]] = entry[b, h, i]``, ``slots`` ``[batch, kv_heads, n]``, ``entry`` a tensor of
    ``slots``' shape (with ``target``'s trailing dimensions) or one value.

    Inside a compiled step the write is an ``index_put_``, which inductor does in place; it makes a ``scatter_`` on a
    graph's input a new tensor, copied back into the input, so that every step would copy the whole layer twice.

        >>> live = torch.ones(1, 2, 4, dtype=torch.bool)
        >>> write_slots(live, torch.tensor([[[3], [0]]]), False)
        >>> live.int().tolist()
        [[[1, 1, 1, 0], [0, 1, 1, 1]]]
    """
    if torch.compiler.is_compiling():
        batch, heads = slots.shape[:2]
        rows = torch.arange(batch, device=slots.device).view(-1, 1, 1)
        columns = torch.arange(heads, device=slots.device).view(1, -1, 1)
        if not isinstance(entry, torch.Tensor):  # made on the target's device: no CPU constant in a CUDA graph
            entry = torch.full((), entry, dtype=target.dtype, device=target.device)
        target[rows, columns, slots] = entry
        return
    if isinstance(entry, torch.Tensor) and entry.dim() > slots.dim():
        slots = slots.view(*slots.shape, *(1,) * (entry.dim() - slots.dim())).expand_as(entry)
    target.scatter_(2, slots, entry)


def _write(target: torch.Tensor, entry: torch.Tensor | float | bool) -> None:
    """Fill ``target`` with ``entry``: a tensor (broadcast) or one value."""
    if isinstance(entry, torch.Tensor):
        target.copy_(entry)
    else:
        target.fill_(entry)


class EntryStorage:
    """Where a ``CompressedLayer``'s entries live and how they are written, moved and read back."""

    def _forget_freed(self) -> None:
        """Mark the list of freed slots used up (after anything that moves entries or changes which are live). The
        tensor stays, so that the next eviction in a compiled step writes into it instead of returning a new one,
        which the cache would then hold (a CUDA graph overwrites what it returned when it runs again)."""
        if self._freed is not None:
            self._freed_taken = self._freed.shape[-1]

    def _catch_up(self) -> None:
        """Extend the bookkeeping views over the decoding steps appended to the reserved room since they last
        covered every entry (those steps wrote their keys and values only: the room was prepared for them)."""
        if self._lagging:
            self._lagging = False
            slots = self.slots
            for name in self.bookkeeping:
                setattr(self, name, self._room_view(name, 0, slots))

    @property
    def slots(self) -> int:
        """Stored entries per row and KV head, live or not."""
        return self.keys.shape[-2] if self.is_initialized else 0

    def _start_coding(self, key_states: torch.Tensor) -> None:
        """On the first pass: make the ring of exact recent entries."""
        batch, kv_heads, _, head_dim = key_states.shape
        ring = self.policy.exact_recent
        self.recent_keys = key_states.new_zeros((batch, kv_heads, ring, head_dim), dtype=self.storage_dtype)
        self.recent_values = torch.zeros_like(self.recent_keys)
        self.recent_positions = torch.full((ring,), -1, dtype=torch.int32, device=key_states.device)
        for ring_tensor in (self.recent_keys, self.recent_values, self.recent_positions):
            mark_static(ring_tensor)

    def _code(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """What a pass's keys and values store as: themselves (in 16 bits with ``kv_bits=16``), or their codes,
        scales and offsets; and the pass's keys as attention reads them (turned as coded when the layer
        ``reads_turned_keys``, from the coding's own turn)."""
        coded, read_keys = {}, key_states
        pass_states = (key_states, value_states)
        for part, states, encoded in zip(PARTS, pass_states, self._encoded(*pass_states), strict=True):
            if encoded is None:
                coded[part] = self._in_storage_dtype(states)
                continue
            codes, turned = encoded
            if part == "keys" and self.reads_turned_keys:
                read_keys = turned.to(states.dtype)
            prefix = part[:-1]
            coded[part], coded[f"{prefix}_scales"], coded[f"{prefix}_offsets"] = codes.values()
        return coded, read_keys

    def _encoded(self, key_states: torch.Tensor, value_states: torch.Tensor) -> list[tuple | None]:
        """Per part, its codes and the states as coded (``Quantizer.encode_turned``), or None where the part is
        stored as it is. Keys and values coded in the same groups (whatever their widths and turns) are coded in one
        pass."""
        keys_coding, values_coding = (self.quantizers[part] for part in PARTS)
        if keys_coding is None or values_coding is None or not keys_coding.groups_like(values_coding):
            return [None if quantizer is None else quantizer.encode_turned(states, self.storage_dtype)
                    for quantizer, states in ((keys_coding, key_states), (values_coding, value_states))]  # fmt: skip
        turned = [keys_coding.as_coded(key_states), values_coding.as_coded(value_states)]
        widths = [keys_coding, values_coding]
        return list(zip(values_coding.encode_together(turned, self.storage_dtype, widths), turned, strict=True))

    def _in_storage_dtype(self, states: torch.Tensor) -> torch.Tensor:
        """``states`` in the storage dtype; a 32-bit value beyond float16's range is held at its largest."""
        dtype = self.storage_dtype
        if states.dtype == dtype:
            return states
        limit = torch.finfo(dtype).max
        return states.clamp(-limit, limit).to(dtype)

    def _remember_recent(self, read_keys: torch.Tensor, value_states: torch.Tensor) -> None:
        """Keep the exact keys (as attention reads them: ``_as_read``) and values of the pass's last tokens (up to
        the ring's size) in the ring."""
        ring = self.recent_keys.shape[2]
        count = min(read_keys.shape[2], ring)
        if count == 0:  # residual_length=0: no exact copies
            return
        positions = positions_from(self._seen_now() - count, count, read_keys.device, torch.int32)
        slots = (positions % ring).long()
        self.recent_keys.index_copy_(2, slots, self._in_storage_dtype(read_keys[:, :, -count:]))
        self.recent_values.index_copy_(2, slots, self._in_storage_dtype(value_states[:, :, -count:]))
        self.recent_positions.index_copy_(0, slots, positions)

    def write_pass_exact(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the stored pass's own keys (as attention reads them) and values, exact, into ``keys`` and ``values``
        (``dense``'s copy, or a view of one, ``[batch, kv_heads, slots, head_dim]``) where they were stored: in the
        pass's free slots, or after the other entries. Nothing to do when attention reads the stored tensors
        themselves."""
        if keys is self.keys:  # stored as they are
            return
        stored = self._stored_pass
        free, key_states, value_states = stored.free, stored.read_keys, stored.value_states
        if free is None:
            new = key_states.shape[2]
            keys[:, :, -new:], values[:, :, -new:] = key_states, value_states
        else:
            write_slots(keys, free[..., None], key_states)
            write_slots(values, free[..., None], value_states)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored keys and values in the cache's dtype, ``[batch, kv_heads, slots, head_dim]``, as attention
        reads them: with quantized storage, decoded, the entries still in the ring exact; with ``kv_bits=16`` in a
        32-bit model, cast back."""
        if not self.quantized:
            if self.storage_dtype == self.dtype:
                return self.keys, self.values
            return self.keys.to(self.dtype), self.values.to(self.dtype)  # 16-bit storage of a 32-bit model
        keys, values = (self._decoded(part) for part in PARTS)
        self.write_ring(keys, values)
        return keys, values

    def write_ring(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the exact copies the ring still holds into ``keys`` and ``values`` (the stored entries decoded,
        ``[batch, kv_heads, slots, head_dim]``, or a view of them)."""
        ring = self.recent_keys.shape[2]
        if ring == 0:  # residual_length=0: every stored entry is read from its codes
            return
        # The ring's tokens are the latest positions: find the slots of the last ``ring`` positions and, where
        # the ring still holds that position (a crop or replay may have overwritten it), read it exact.
        latest = self.positions.topk(min(ring, self.slots), dim=-1).indices  # [batch, kv_heads, ring]
        latest_positions = self.positions.gather(2, latest)
        ring_slot = (latest_positions % ring).long()
        held = (self.recent_positions[ring_slot] == latest_positions)[..., None]
        head_dim = keys.shape[-1]
        into, out_of = latest[..., None].expand(-1, -1, -1, head_dim), ring_slot[..., None].expand(-1, -1, -1, head_dim)
        for decoded, recent in ((keys, self.recent_keys), (values, self.recent_values)):
            exact = recent.gather(2, out_of).to(self.dtype)
            write_slots(decoded, latest, torch.where(held, exact, decoded.gather(2, into)))

    def _decoded(self, part: str) -> torch.Tensor:
        """The stored ``part`` ("keys" or "values") decoded to the cache's dtype (ring aside)."""
        turned = part == "keys" and self.reads_turned_keys
        return decoded_part(part, self.quantizers[part], lambda name: getattr(self, name), self.dtype, turned=turned)

    def _as_read(self, key_states: torch.Tensor) -> torch.Tensor:
        """Exact keys as attention reads them: turned like their codes when the layer ``reads_turned_keys``."""
        if not self.reads_turned_keys:
            return key_states
        return turn(key_states.float()).to(key_states.dtype)

    def _has_spare(self) -> bool:
        """Whether the per-entry tensors are views of larger ones (spare room, possibly all used).

        Keys and values are checked here (something outside may replace them, as an offload does): they must be the
        very tensors the layer placed (``_place``), an identity that ``torch.compile`` traces and a deep copy keeps;
        the bookkeeping tensors are replaced only through their setters, which give up the room then
        (``_replace_bookkeeping``)."""
        spare = self._spare
        if spare is not None and not (self._was_placed("keys", self.keys) and self._was_placed("values", self.values)):
            self._catch_up()  # the bookkeeping views first cover the steps appended to the room
            self._give_up_room()  # the tensors were replaced (rows reordered, a replay...)
            return False
        return spare is not None

    def _give_up_room(self) -> None:
        """Hold no spare room (nor the steps' views of it)."""
        self._spare = None
        self._room_views = {}

    def _room_is_contiguous(self) -> bool:
        """Whether the layer holds spare room whose tensors are each one contiguous block (not a head's slice of a
        larger one), so that entries can move within it by slot rows (``move_tail_into``)."""
        return self._has_spare() and all(self._spare[name].is_contiguous() for name in self.entries)

    def _hold_room(self, spare: dict[str, torch.Tensor], shared: bool) -> None:
        """Keep ``spare`` as the reserved room (``shared``: this layer's slices of the room the layers share). On
        CUDA its tensors are marked as static addresses here, outside any compiled step: the first compiled step of
        a room filling up places them whole (``_open_room``), where they can no longer be marked."""
        self._spare, self._room_shared = spare, shared
        self._room_views = {}
        if self._marks_static:
            for tensor in spare.values():
                mark_static(tensor)

    def _replace_bookkeeping(self, name: str, value: torch.Tensor | None) -> None:
        """Set the bookkeeping tensor ``name`` (as its property's setter does); the reserved room is given up
        unless ``value`` is a view of its start."""
        setattr(self, name, value)
        if self._marks_static:
            mark_static(value)
        spare = self._spare
        if spare is not None and name in spare and (value is None or not _views_from_start(value, spare[name])):
            self._give_up_room()

    def _place(self, name: str, tensor: torch.Tensor | None) -> None:
        """Set the per-entry tensor ``name``; keys and values are remembered as placed by the layer (``_has_spare``),
        weakly, so that a tensor replaced from outside (as an offload does) is not kept alive by the memory of it."""
        setattr(self, name, tensor)
        if self._marks_static:
            mark_static(tensor)
        if name in PARTS:
            self._placed[name] = None if tensor is None else weakref.ref(tensor)

    def _was_placed(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the very tensor the layer last placed as ``name`` (``_place``)."""
        placed = self._placed.get(name)
        return placed is not None and placed() is tensor

    def _store(self, coded: dict[str, torch.Tensor], value_states: torch.Tensor, free, first_pass: bool) -> None:
        """Store a pass's entries (``coded``: keys and values as stored, see ``_code``): one token into each
        row's ``free`` slot, or after the stored entries."""
        batch, kv_heads, new, _ = value_states.shape
        positions = positions_from(self._seen_now(), new, value_states.device, torch.int32)
        positions = positions.expand(batch, kv_heads, new)
        value_norms = value_states.float().norm(dim=-1) if "_value_norms" in self.bookkeeping else None
        if free is not None:
            self._fill(free, coded, value_norms, positions)
            return
        live = positions >= self.pads[:, None, None] if first_pass else True
        biases = 0.0 if "_biases" in self.bookkeeping else None
        entries = {**coded, "_scores": 0.0, "_value_norms": value_norms, "_positions": positions, "_live": live,
                   "_biases": biases}  # fmt: skip
        self._append({name: entry for name, entry in entries.items() if entry is not None}, first_pass)

    def _has_room_for_step(self, dtype: torch.dtype) -> bool:
        """Whether one decoding step's key and value, in ``dtype``, can be written as they are into the spare
        room (storage neither quantized nor in another dtype, and a free slot after the stored ones)."""
        return not self.quantized and self.storage_dtype == dtype and self._spare_room() >= 1

    def _spare_room(self) -> int:
        """How many entries fit after the stored ones without moving them (0 without spare room)."""
        return self._spare["keys"].shape[2] - self.slots if self._has_spare() else 0

    def _append(self, entries: dict[str, torch.Tensor | float | bool], first_pass: bool) -> None:
        """Store ``entries`` (a tensor, or one value for every new entry) after the stored ones: in spare
        room when it fits, else in new tensors.

        One decoding step reserves room for the steps up to the next eviction, at least ``GROWTH_ROOM`` slots
        when the target grows with the tokens seen (``size.reserved_room``; never beyond ``budget + 1`` slots),
        so that those steps copy one entry each instead of the whole layer.
        """
        self._catch_up()
        new, stored = entries["keys"].shape[2], 0 if first_pass else self.slots
        if self._spare_room() >= new:
            for name, entry in entries.items():
                base = self._spare[name]
                _write(base.narrow(2, stored, new), entry)
                self._place(name, base.narrow(2, 0, stored + new))
            return
        self._give_up_room()
        fixed = self._fixed_target()
        room = reserved_room(self.policy.eviction_interval, grows=fixed is None)
        capacity = stored + new
        reserve = not first_pass and new == 1 and room > 1 and self.pad_range[1] == 0
        if reserve:
            capacity += room - 1
            if fixed is not None:
                capacity = max(stored + new, min(capacity, fixed + 1))
        spare = {}
        batch, kv_heads = entries["keys"].shape[:2]
        for name, entry in entries.items():
            old = getattr(self, name)
            trailing = entry.shape[3:] if isinstance(entry, torch.Tensor) else ()
            shape = (batch, kv_heads, capacity, *trailing)
            shared = reserve and self.shared is not None
            base = self.shared.room(self.shared_index, name, shape, old) if shared else old.new_empty(shape)
            if stored:
                base.narrow(2, 0, stored).copy_(old)
            _write(base.narrow(2, stored, new), entry)
            spare[name] = base
            self._place(name, base.narrow(2, 0, stored + new))
        if reserve:  # kept even when full: the next eviction moves the kept entries to its front
            self._hold_room(spare, shared=shared and not torch.compiler.is_compiling() and base._base is not None)
            self._prepare_room(stored + new, self._seen_now() + new)

    def _reserve_room_for_steps(self) -> None:
        """After a pass of several tokens, under a budget in tokens evicting at intervals, unpadded: reserve the room
        that the first decoding step would (``_append``), the stored entries at the front of the layers' slices of
        shared tensors of up to ``budget + 1`` slots and the slots after them prepared, so that the first step
        appends to it with its scoring waiting, as the next steps do."""
        fixed = self._fixed_target()
        interval = self.policy.eviction_interval
        if fixed is None or interval == 1 or self.shared is None or self.pad_range[1] != 0 or self._has_spare():
            return
        stored = self.slots
        capacity = min(stored + interval, fixed + 1)
        if capacity <= stored or torch.compiler.is_compiling():
            return
        spare = {}
        for name in self.entries:
            held = getattr(self, name)
            base = self.shared.room(self.shared_index, name, (*held.shape[:2], capacity, *held.shape[3:]), held)
            base.narrow(2, 0, stored).copy_(held)
            spare[name] = base
            self._place(name, base.narrow(2, 0, stored))
        self._hold_room(spare, shared=spare["keys"]._base is not None)
        self._prepare_room(stored, self._seen_now())

    def _prepare_room(self, filled: int, next_position: int) -> None:
        prepare_room(self._spare, 2, filled, next_position)

    def _append_to_prepared_room(self, coded: dict[str, torch.Tensor]) -> None:
        """One decoding step whose scoring waits: only its key and value (as stored) are written, and only their
        views extended; the bookkeeping views follow when read (``_catch_up``)."""
        stored = self.keys.shape[-2]
        for name, entry in coded.items():
            slot, grown = self._step_view(name, stored)
            slot.copy_(entry)
            self._place(name, grown)
        self._lagging = True

    def _step_view(self, name: str, stored: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The spare room's slot after ``stored`` entries of kind ``name``, and its first ``stored + 1`` entries (one
        check for a compiled step, as every decoding step asks for them)."""
        if torch.compiler.is_compiling():
            base = self._spare[name]
            return base.narrow(2, stored, 1), base.narrow(2, 0, stored + 1)
        return self._kept_room_view(name, stored, 1), self._kept_room_view(name, 0, stored + 1)

    def _room_view(self, name: str, start: int, length: int) -> torch.Tensor:
        """The spare room's ``length`` slots from ``start`` for entries of kind ``name``: made once per room in eager
        steps (the intervals between evictions repeat them), anew in a compiled step."""
        if torch.compiler.is_compiling():
            return self._spare[name].narrow(2, start, length)
        return self._kept_room_view(name, start, length)

    def _kept_room_view(self, name: str, start: int, length: int) -> torch.Tensor:
        """``_room_view`` outside a compiled step: from the room's table of views, made on first use."""
        key = (name, start, length)
        view = self._room_views.get(key)
        if view is None:
            view = self._room_views[key] = self._spare[name].narrow(2, start, length)
        return view

    def _fill(self, free, coded, value_norms, positions) -> None:
        """Write a decoding step's entries (``coded``, then the bookkeeping) into each row and head's ``free`` slot."""
        one = free.numel() == 1  # one row and head (a head unit at batch 1): index_copy_ at one slot, nothing expanded
        slot = free.view(1) if one else free[..., None]
        by_width = {}  # the slot index expanded to each entry width, made once per width
        biases = None if self._biases is None else 0.0
        written = {**coded, "scores": 0.0, "value_norms": value_norms, "positions": positions, "live": True,
                   "biases": biases}  # fmt: skip
        for name, entry in written.items():
            if entry is None:
                continue
            target = getattr(self, name)
            if one:
                (target.index_copy_ if isinstance(entry, torch.Tensor) else target.index_fill_)(2, slot, entry)
                continue
            if torch.compiler.is_compiling():
                write_slots(target, slot, entry)  # in place (a scatter_ would copy the whole tensor)
                continue
            index = slot  # bookkeeping: one number per entry
            if isinstance(entry, torch.Tensor) and entry.dim() == 4:  # keys, values, scales: channels per entry
                width = entry.shape[-1]
                if width not in by_width:
                    by_width[width] = slot[..., None].expand(-1, -1, -1, width)
                index = by_width[width]
            target.scatter_(2, index, entry)

    def _fill_victims_slots(self, victims: torch.Tensor) -> None:
        """Keep every entry but ``victims`` (``[batch, kv_heads, n]`` slots, all before the last ``n``) in the spare
        room, the last ``n`` entries taking the victims' slots (``move_tail_into``), and prepare the room after them."""
        self._forget_freed()
        self._score_pending()
        keep = self.slots - victims.shape[2]
        rows = slot_rows(victims, self._spare["keys"].shape[2])
        for name in self.entries:
            room = self._spare[name]
            move_tail_into(room, 2, keep, rows)
            self._place(name, self._room_view(name, 0, keep))
        self._prepare_room(keep, self._seen_now())

    def _keep(self, index: torch.Tensor) -> None:
        """Keep the entries at ``index`` ([batch, kv_heads, n] slots), in that order (at the front of the
        spare room's tensors when there is one)."""
        self._forget_freed()
        self._score_pending()
        in_place = self._has_spare()
        count = index.shape[2]
        # In place, entries are taken from the whole room, which is contiguous (``index`` is below ``slots``).
        rows = slot_rows(index, self._spare["keys"].shape[2] if in_place else self.slots)
        for name in self.entries:
            if in_place:
                room = self._spare[name]
                kept = room.narrow(2, 0, count).copy_(take_slots(room, index, rows))
            else:
                kept = take_slots(getattr(self, name), index, rows)
            self._place(name, kept)
        if in_place:
            self._prepare_room(index.shape[2], self._seen_now())

    def kept_positions(self) -> torch.Tensor:
        """The logical positions of the live tokens, ``[batch, kv_heads, kept]``, increasing.

        A row that keeps fewer tokens than ``kept`` (more padding, a smaller ratio target) is
        filled with -1 at the front, as a left-padded batch is.
        """
        if not self.is_initialized:
            return torch.zeros(0, 0, 0, dtype=torch.int32)
        positions = self.positions.masked_fill(~self.live, -1).sort(dim=-1).values
        return positions[..., positions.shape[-1] - self.kept :]
