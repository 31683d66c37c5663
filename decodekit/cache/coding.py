"""How a layer's keys and values are stored: as they are (``PlainCoding``) or as integer codes with group scales
and offsets (``QuantizedCoding``), and how attention reads them back.

A coding names the storage fields it needs, makes them of a pass's keys and values, and decodes stored entries
for attention. Quantized keys are coded after a Hadamard rotation (``quantize.py``); where the attention module's
queries can be rotated alike (``rotated_reads``), attention reads the keys as coded, never rotated back. The last
``residual_length`` tokens are also held exact in a residual window (KIVI's full-precision recent tokens), and
attention reads them exact.

Coded keys may be smoothed first (SageAttention's smooth K; ``smooth_keys``): each row and KV head's mean key over the
first pass's tokens is subtracted before coding and added back when decoding, so that the codes spend their range on
what tells keys apart (``benchmarks/results/kv_key_smoothing_cpu.txt``).
"""

from __future__ import annotations

import numpy as np
import torch

from decodekit.cache import _native
from decodekit.cache.quantize import Quantizer
from decodekit.cache.quantize import rotate as hadamard_rotate
from decodekit.cache.storage import EntryStorage, Field, mark_static
from decodekit.settings import CODED_BITS

PARTS = ("keys", "values")


def storage_dtype(model_dtype: torch.dtype, kv_bits: int | None) -> torch.dtype:
    """What keys and values (or their group scales) are stored in: the model's dtype, or 16 bits where the storage
    is sized in bits and the model's dtype is wider (float16, llama.cpp's f16 cache for a 32-bit model).

    Example:
        >>> storage_dtype(torch.float32, None), storage_dtype(torch.float32, 16), storage_dtype(torch.bfloat16, 4)
        (torch.float32, torch.float16, torch.bfloat16)
    """
    if kv_bits is not None and model_dtype.itemsize > 2:
        return torch.float16
    return model_dtype


def in_dtype(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``states`` in ``dtype``; a 32-bit value beyond a 16-bit dtype's range is held at its largest."""
    if states.dtype == dtype:
        return states
    if dtype.itemsize < states.dtype.itemsize:
        limit = torch.finfo(dtype).max
        states = states.clamp(-limit, limit)
    return states.to(dtype)


class PlainCoding:
    """Keys and values stored as they are: in the model's dtype, or in 16 bits (``kv_bits=16``)."""

    rotated_reads = False
    quantized = False

    def __init__(self, kv_bits: int | None = None) -> None:
        self.kv_bits = kv_bits
        self.model_dtype = self.stored_dtype = None

    def start(self, key_states: torch.Tensor, pads: np.ndarray | None = None) -> None:
        """The first pass: store in its dtype, or in 16 bits (``kv_bits=16``)."""
        self.model_dtype = key_states.dtype
        self.stored_dtype = storage_dtype(key_states.dtype, self.kv_bits)

    def fields(self, head_dim: int) -> dict[str, Field]:
        return {part: Field((head_dim,), self.stored_dtype) for part in PARTS}

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The storage fields of a pass's ``keys`` and ``values``, and its keys as attention reads them."""
        return {"keys": in_dtype(keys, self.stored_dtype), "values": in_dtype(values, self.stored_dtype)}, keys

    def reads_in_place(self) -> bool:
        """Whether attention reads the stored tensors as they are (views, no copy)."""
        return self.stored_dtype == self.model_dtype

    def decode(self, storage: EntryStorage, stop: int, valid=None, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of each segment's first ``stop`` slots in ``dtype`` (default: the model's), ``[batch,
        heads, stop, dim]``."""
        dtype = dtype or self.model_dtype
        keys, values = storage.read("keys", stop), storage.read("values", stop)
        if self.stored_dtype == dtype and storage.reads_views(stop):
            return keys, values
        return keys.to(dtype, copy=True), values.to(dtype, copy=True)

    def remember(self, read_keys, values, positions) -> None:
        """Nothing: plain entries are exact."""

    def state(self) -> dict[str, torch.Tensor]:
        """Nothing beyond the storage."""
        return {}

    def restore(self, model_dtype: torch.dtype, tensors: dict[str, torch.Tensor], device) -> None:
        """Take up a saved cache's dtypes (``state`` holds nothing)."""
        self.model_dtype, self.stored_dtype = model_dtype, storage_dtype(model_dtype, self.kv_bits)

    def write_values(self, storage: EntryStorage, slots, fitted: torch.Tensor, positions, lanes=None) -> None:
        """Store ``fitted`` (float32 ``[batch, heads, n, dim]``) as the values at each segment's ``slots``."""
        storage.write_slots(slots, {"values": in_dtype(fitted.to(self.model_dtype), self.stored_dtype)}, lanes)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Nothing per row."""

    def reset(self) -> None:
        """Nothing held."""

    def held_tensors(self) -> list[torch.Tensor]:
        return []


class QuantizedCoding:
    """Keys and values stored as codes of ``key_bits`` and ``value_bits`` bits (8, 5, 4, 3 or 2; None: that part stored
    as it is, in 16 bits) in groups of ``group_size`` channels, with a residual window of the last
    ``residual_length`` tokens held exact, coded keys less each row and head's mean key where ``smooth_keys``.
    ``rotated_reads``: attention reads coded keys Hadamard-rotated (set where the attention module's queries are
    rotated alike)."""

    def __init__(
        self, key_bits: int | None, value_bits: int | None, group_size: int, residual_length: int,
        smooth_keys: bool = True,
    ) -> None:
        self.model_dtype = self.stored_dtype = None
        self.quantizers = {
            "keys": Quantizer(key_bits, group_size, rotated=True) if key_bits in CODED_BITS else None,
            "values": Quantizer(value_bits, group_size) if value_bits in CODED_BITS else None,
        }
        self.residual_length = residual_length
        self.rotated_reads = False
        self.residual_keys = self.residual_values = self.residual_positions = None
        self.smooth_keys = smooth_keys and self.quantizers["keys"] is not None
        # Where keys are smoothed, each row and KV head's mean key, float32 [batch, heads, 1, head_dim], and the same
        # Hadamard-rotated (as keys are coded): set by the first pass; None where keys are coded whole.
        self.key_means = self.coded_key_means = None

    quantized = True

    def fields(self, head_dim: int) -> dict[str, Field]:
        fields = {}
        for part, quantizer in self.quantizers.items():
            if quantizer is None:
                fields[part] = Field((head_dim,), self.stored_dtype)
                continue
            groups = quantizer.groups(head_dim)
            fields[part] = Field((head_dim * quantizer.bits // 8,), torch.uint8)
            fields[f"{part[:-1]}_scales"] = Field((groups,), self.stored_dtype)
            fields[f"{part[:-1]}_offsets"] = Field((groups,), self.stored_dtype)
        return fields

    def reads_in_place(self) -> bool:
        return False

    def start(self, key_states: torch.Tensor, pads: np.ndarray | None = None) -> None:
        """The first pass: scales (and parts not coded) in 16 bits, the residual window for its rows and heads, and
        under ``smooth_keys`` each row and head's mean key over its tokens (after its left padding, ``pads``)."""
        self.model_dtype = key_states.dtype
        self.stored_dtype = storage_dtype(key_states.dtype, 16)
        batch, heads, _, head_dim = key_states.shape
        ring, device = self.residual_length, key_states.device
        self.residual_keys = torch.zeros((batch, heads, ring, head_dim), dtype=self.stored_dtype, device=device)
        self.residual_values = torch.zeros_like(self.residual_keys)
        self.residual_positions = torch.full((ring,), -1, dtype=torch.int32, device=device)
        for tensor in (self.residual_keys, self.residual_values, self.residual_positions):
            mark_static(tensor)
        if self.smooth_keys:
            self.set_key_means(mean_keys(key_states, pads))

    @property
    def smoothing(self) -> bool:
        """Whether keys are coded less their mean key (``smooth_keys``, once the first pass gave the mean)."""
        return self.key_means is not None

    def set_key_means(self, means: torch.Tensor) -> None:
        """Smooth keys by ``means``, float32 ``[batch, heads, 1, head_dim]`` (what ``start`` takes from a first
        pass)."""
        self.key_means = means
        self.coded_key_means = hadamard_rotate(means)
        mark_static(self.key_means)
        mark_static(self.coded_key_means)

    def smoothed(self, coded_keys: torch.Tensor) -> torch.Tensor:
        """Keys as coded (float32, rotated), less their row and head's mean where keys are smoothed."""
        return coded_keys - self.coded_key_means if self.smoothing else coded_keys

    def read_key_means(self) -> torch.Tensor | None:
        """What decoded keys get back (their mean, rotated where reads are rotated), float32 ``[batch, heads, 1,
        head_dim]``; None where keys are not smoothed."""
        if not self.smoothing:
            return None
        return self.coded_key_means if self.rotated_reads else self.key_means

    def as_read(self, keys: torch.Tensor) -> torch.Tensor:
        """Exact keys as attention reads them: Hadamard-rotated like their codes where reads are rotated."""
        if not (self.rotated_reads and self.quantizers["keys"] is not None):
            return keys
        return hadamard_rotate(keys.float()).to(keys.dtype)

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The storage fields of a pass's ``keys`` and ``values`` (codes, scales and offsets per coded part), and its
        keys as attention reads them (rotated as coded where reads are rotated, from the coding's own rotation)."""
        fields, read_keys = {}, keys
        key_coding, value_coding = self.quantizers["keys"], self.quantizers["values"]
        rotated = [None if quantizer is None else quantizer.as_coded(states)
                   for quantizer, states in ((key_coding, keys), (value_coding, values))]  # fmt: skip
        to_code = rotated if rotated[0] is None else [self.smoothed(rotated[0]), rotated[1]]
        if key_coding is not None and value_coding is not None and key_coding.groups_like(value_coding):
            coded = value_coding.encode_together(to_code, self.stored_dtype, [key_coding, value_coding])
        else:
            coded = [None if quantizer is None else quantizer.encode_together([states], self.stored_dtype)[0]
                     for quantizer, states in zip((key_coding, value_coding), to_code, strict=True)]  # fmt: skip
        encoded = [None if codes is None else (codes, exact) for codes, exact in zip(coded, rotated, strict=True)]
        for part, states, pair in zip(PARTS, (keys, values), encoded, strict=True):
            if pair is None:
                fields[part] = in_dtype(states, self.stored_dtype)
                continue
            codes, rotated = pair
            if part == "keys" and self.rotated_reads:
                read_keys = rotated.to(states.dtype)
            prefix = part[:-1]
            fields[part], fields[f"{prefix}_scales"], fields[f"{prefix}_offsets"] = codes.values()
        return fields, read_keys

    def residual_window(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The residual window's exact keys (as attention reads them) and values, ``[batch, heads, ring, head_dim]``
        in the stored dtype, and the position each ring slot holds (``[ring]``, int32, -1: none); None without one."""
        if self.residual_length == 0:
            return None
        return self.residual_keys, self.residual_values, self.residual_positions

    def appends_steps_natively(self, storage: EntryStorage) -> bool:
        """Whether ``append_step`` codes a decoding step's entry into ``storage`` with one C++ operator: keys and
        values both coded in groups of one size, on a CPU where the operators are built."""
        keys, values = self.quantizers["keys"], self.quantizers["values"]
        return (
            keys is not None and values is not None and keys.groups_like(values) and _native.runs_on(storage.device)
        )  # fmt: skip

    def append_step(
        self, storage: EntryStorage, keys: torch.Tensor, values: torch.Tensor, position: int,
        others: dict[str, torch.Tensor | float],
    ) -> torch.Tensor:
        """Code a decoding step's ``keys`` and ``values`` (``[batch, heads, 1, head_dim]``) into the free slot after
        each segment's entries, at ``position``, with the fields ``others`` (``storage.append_coded``; where
        ``appends_steps_natively``), and keep them exact in the residual window; returns the keys as attention reads
        them. The bytes ``encode`` then ``storage.append`` write."""
        key_coding, value_coding = self.quantizers["keys"], self.quantizers["values"]
        rows, read_keys = self.step_rows(keys)
        parts = [("keys", rows, key_coding.bits), ("values", values, value_coding.bits)]
        storage.append_coded(parts, value_coding.group_size, position, others)
        if self.residual_length:
            self.remember(read_keys, values, torch.tensor([position], dtype=torch.int32, device=keys.device))
        return read_keys

    def step_rows(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoding step's ``keys`` (``[batch, heads, 1, head_dim]``, coded keys) as coded (float32, rotated, less
        their mean where smoothed) and as attention reads them."""
        rotated = self.quantizers["keys"].as_coded(keys)
        return self.smoothed(rotated), rotated.to(keys.dtype) if self.rotated_reads else keys

    def decode(
        self, storage: EntryStorage, stop: int, valid: torch.Tensor | None = None, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of each segment's first ``stop`` slots decoded to the model's dtype, the entries the
        residual window still holds exact; keys rotated where reads are rotated. ``valid``: the slots that hold an
        entry, ``[batch, heads, stop]`` (None: from the host's lengths); ``dtype``: default the model's."""
        dtype = dtype or self.model_dtype
        coded = ("keys", "values", "key_scales", "key_offsets", "value_scales", "value_offsets")
        names = [name for name in coded if name in storage.fields] + (["positions"] if self.residual_length else [])
        read = storage.read_many(names, stop)
        decoded = []
        for part in PARTS:
            quantizer = self.quantizers[part]
            if quantizer is None:
                decoded.append(read[part].to(dtype, copy=True))
                continue
            prefix = part[:-1]
            coded = {"codes": read[part], "scales": read[f"{prefix}_scales"], "offsets": read[f"{prefix}_offsets"]}
            rotated = part == "keys" and self.rotated_reads
            states = quantizer.decode(coded, dtype, rotate_back=not rotated)
            if part == "keys" and self.smoothing:
                states = (states.float() + self.read_key_means()).to(dtype)
            decoded.append(states)
        keys, values = decoded
        if self.residual_length:
            positions = read["positions"]
            if valid is None and (not storage.equal_lengths or storage.length_range[0] < stop):
                valid = storage.valid(stop)
            if valid is not None:
                positions = torch.where(valid, positions, -1)  # (a free slot holds no token)
            self._write_residual(positions, keys, values)
        return keys, values

    def _write_residual(self, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the exact entries the residual window still holds into decoded ``keys`` and ``values``."""
        ring = self.residual_length
        if ring == 0 or positions.shape[-1] == 0:
            return
        latest = positions.topk(min(ring, positions.shape[-1]), dim=-1).indices  # [batch, heads, ring]
        latest_positions = positions.gather(2, latest)
        ring_slot = (latest_positions % ring).long()
        held = (self.residual_positions[ring_slot] == latest_positions)[..., None]
        head_dim = keys.shape[-1]
        into = latest[..., None].expand(-1, -1, -1, head_dim)
        out_of = ring_slot[..., None].expand(-1, -1, -1, head_dim)
        for dense, exact in ((keys, self.residual_keys), (values, self.residual_values)):
            kept = exact.gather(2, out_of).to(dense.dtype)
            dense.scatter_(2, into, torch.where(held, kept, dense.gather(2, into)))

    def remember(self, read_keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Keep the exact keys (as attention reads them) and values of a pass's last tokens (up to the window's size),
        at ``positions`` (``[tokens]``, int32, the pass's)."""
        ring = self.residual_length
        count = min(read_keys.shape[2], ring)
        if count == 0:
            return
        positions = positions[-count:]
        slots = (positions % ring).long()
        self.residual_keys.index_copy_(2, slots, in_dtype(read_keys[:, :, -count:], self.stored_dtype))
        self.residual_values.index_copy_(2, slots, in_dtype(values[:, :, -count:], self.stored_dtype))
        self.residual_positions.index_copy_(0, slots, positions.to(torch.int32))

    def write_values(self, storage: EntryStorage, slots, fitted: torch.Tensor, positions, lanes=None) -> None:
        """Store ``fitted`` (float32 ``[batch, heads, n, dim]``) as the values at each segment's ``slots`` (where
        ``lanes``), coded as values are coded, and exact into the residual window where it holds those ``positions``."""
        quantizer = self.quantizers["values"]
        if quantizer is None:
            storage.write_slots(slots, {"values": in_dtype(fitted.to(self.model_dtype), self.stored_dtype)}, lanes)
        else:
            coded = quantizer.encode(fitted, self.stored_dtype)
            storage.write_slots(slots, {"values": coded["codes"], "value_scales": coded["scales"],
                                        "value_offsets": coded["offsets"]}, lanes)  # fmt: skip
        ring = self.residual_length
        if ring:
            ring_slots = (positions % ring).long()
            held = self.residual_positions[ring_slots] == positions.to(torch.int32)
            if lanes is not None:
                held &= lanes
            rows, heads, lanes_held = held.nonzero(as_tuple=True)
            exact = fitted[rows, heads, lanes_held].to(self.residual_values.dtype)
            self.residual_values[rows, heads, ring_slots[rows, heads, lanes_held]] = exact

    def state(self) -> dict[str, torch.Tensor]:
        """The residual window and the mean keys, to be saved (``persist.py``)."""
        state = {"residual_keys": self.residual_keys, "residual_values": self.residual_values,
                 "residual_positions": self.residual_positions}  # fmt: skip
        if self.smoothing:
            state["key_means"] = self.key_means
        return state

    def restore(self, model_dtype: torch.dtype, tensors: dict[str, torch.Tensor], device) -> None:
        """Take up a saved cache's dtypes and residual window (``state``)."""
        self.model_dtype, self.stored_dtype = model_dtype, storage_dtype(model_dtype, 16)
        self.residual_keys = tensors["residual_keys"].to(device)
        self.residual_values = tensors["residual_values"].to(device)
        self.residual_positions = tensors["residual_positions"].to(device)
        means = tensors.get("key_means")  # (none where keys were coded whole)
        self.key_means = self.coded_key_means = None
        if means is not None:
            self.set_key_means(means.to(device))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the residual window's rows ``rows``."""
        if self.residual_keys is not None:
            rows = rows.to(self.residual_keys.device)
            self.residual_keys = self.residual_keys.index_select(0, rows)
            self.residual_values = self.residual_values.index_select(0, rows)
        if self.key_means is not None:
            self.set_key_means(self.key_means.index_select(0, rows.to(self.key_means.device)))

    def reset(self) -> None:
        self.residual_keys = self.residual_values = self.residual_positions = None
        self.key_means = self.coded_key_means = None

    def held_tensors(self) -> list[torch.Tensor]:
        held = (self.residual_keys, self.residual_values, self.residual_positions, self.key_means, self.coded_key_means)
        return [tensor for tensor in held if tensor is not None]


def mean_keys(keys: torch.Tensor, pads: np.ndarray | None = None) -> torch.Tensor:
    """Each row and KV head's mean of ``keys`` ``[batch, heads, tokens, head_dim]`` over its tokens after its left
    padding (``pads``, host ``[batch]``; a row of padding alone: zeros), float32 ``[batch, heads, 1, head_dim]``.

    Example:
        >>> keys = torch.tensor([[[[9.0], [1.0], [3.0]]]])
        >>> mean_keys(keys).flatten().tolist(), mean_keys(keys, np.array([1])).flatten().tolist()
        ([4.333333492279053], [2.0])
    """
    keys = keys.float()
    if pads is None or not pads.any():
        return keys.mean(dim=2, keepdim=True)
    tokens = keys.shape[2]
    after = torch.arange(tokens)[None, :] >= torch.from_numpy(pads)[:, None]  # [batch, tokens]
    weights = after.to(keys.device, torch.float32)[:, None, :, None]
    return (keys * weights).sum(dim=2, keepdim=True) / weights.sum(dim=2, keepdim=True).clamp(min=1)
