"""Keys and values stored in 8, 5, 4, 3 or 2 bits: integer codes with a scale and an offset per group of channels.

Each entry (one token of one row and KV head) is quantized on its own, in groups of ``group_size``
channels, asymmetrically (``value ~ offset + code * scale``), so that eviction, beam reorders and
crop move an entry's codes with it and never re-quantize anything. Keys have outlier channels (what
KIVI quantizes per channel for); here a key is first rotated by an orthonormal Hadamard matrix
(``rotated=True``), which spreads an outlier channel's size over all channels, so that no channel
dominates a group's range; decoding rotates it back (the matrix is its own inverse). Measured with
4-bit keys of the default model's prompts (``benchmarks/results/kv_key_coding_cpu.txt``), this takes
the perplexity rise from +1.41% (each channel divided by its magnitude) to +0.01%.

Codes of 4 bits are packed two per byte. Codes of 5 bits are their low 4 bits packed so, followed by their
fifth bits packed eight per byte (``head_dim * 5 / 8`` bytes per entry): keys in 5 bits lost +0.03% and +0.07%
perplexity on two sets of texts where 4 bits lost +0.78% and +0.01% (``benchmarks/results/kv_key_bits_cpu.txt``).
Codes of 2 bits are packed four per byte (channel ``4i + j`` in bits ``2j`` and ``2j + 1`` of byte ``i``); codes of
3 bits are their low 2 bits packed so, followed by their third bits packed eight per byte (channel ``8i + j`` in bit
``j`` of byte ``i``).
Scales and offsets are kept in 16 bits (the cache's dtype); the
offset is rounded down and the scale up before coding, so that every value lies inside its
group's range and rounding a code is the only error: at most half a step, ``scale / 2``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from decodekit._validation import check_int
from decodekit.cache import _native
from decodekit.settings import CODED_BITS

_LITTLE_ENDIAN = sys.byteorder == "little"


def _rounded(values: torch.Tensor, dtype: torch.dtype, toward: float) -> torch.Tensor:
    """``values`` (float32) in ``dtype``, rounded toward ``toward`` (-inf or inf) where rounding moved them away."""
    rounded = values.to(dtype)
    wrong_side = rounded.float() < values if toward > 0 else rounded.float() > values
    return torch.where(wrong_side, torch.nextafter(rounded, torch.full_like(rounded, toward)), rounded)


# The largest codes of parts coded together in other widths (``Quantizer.encode_together``), by widths and device:
# made once, outside any compiled step, so that a step reads them as a constant.
_LEVELS: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}


def _levels(bits: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The largest code of each width in ``bits``, float32 ``[len(bits)]``, made once per widths and device.

    Example:
        >>> _levels((5, 4), torch.device("cpu")).tolist()
        [31.0, 15.0]
    """
    key = (bits, str(device))
    made = _LEVELS.get(key)
    if made is None:
        made = _LEVELS[key] = torch.tensor([float((1 << width) - 1) for width in bits], device=device)
    return made


def rotation_block(head_dim: int) -> int:
    """The size of the Hadamard blocks that turn a ``head_dim``-channel entry: its largest power-of-two divisor
    (the whole entry for 64 or 128 channels; blocks of 16 for 80).

    Example:
        >>> rotation_block(128), rotation_block(80), rotation_block(96)
        (128, 16, 32)
    """
    return head_dim & -head_dim


# The Hadamard matrices made so far, by size and device: made once, outside any compiled step (a quantized layer's
# first pass makes its own), so that a compiled step reads one as a constant and returns none of them.
_HADAMARD: dict[tuple[int, str], torch.Tensor] = {}


def hadamard(size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal Hadamard matrix of ``size`` (a power of two), float32: symmetric, its own inverse. Made once per
    size and device.

    Example:
        >>> h = hadamard(4)
        >>> torch.allclose(h @ h, torch.eye(4)), h[1].tolist(), hadamard(4) is h
        (True, [0.5, -0.5, 0.5, -0.5], True)
    """
    key = (size, str(torch.device(device)))
    made = _HADAMARD.get(key)
    if made is None:
        matrix = torch.ones(1, 1)
        while matrix.shape[0] < size:
            matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
        made = _HADAMARD[key] = (matrix / math.sqrt(size)).to(device)
    return made


def rotate(values: torch.Tensor) -> torch.Tensor:
    """``values`` ``[..., head_dim]`` (float32) rotated by the block-diagonal Hadamard matrix of
    :func:`rotation_block`; rotating twice gives ``values`` back."""
    block = rotation_block(values.shape[-1])
    if block == values.shape[-1]:  # (one block: one product)
        return values @ hadamard(block, values.device)
    rotated = values.unflatten(-1, (-1, block)) @ hadamard(block, values.device)
    return rotated.flatten(-2)


@dataclass(frozen=True)
class Quantizer:
    """How entries are coded: ``bits`` per value (8, 5, 4, 3 or 2) with one scale and offset per ``group_size``
    channels, after a Hadamard rotation of each entry when ``rotated`` (keys).

    Example:
        >>> quantizer = Quantizer(bits=8, group_size=4)
        >>> values = torch.tensor([[[[0.0, 1.0, 2.0, 3.0]]]])
        >>> codes = quantizer.encode(values)
        >>> codes["codes"].dtype, (quantizer.decode(codes, torch.float32) - values).abs().max() < 0.01
        (torch.uint8, tensor(True))
        >>> Quantizer(bits=6)
        Traceback (most recent call last):
        ...
        ValueError: a Quantizer codes in 8, 5, 4, 3 or 2 bits; got 6
    """

    bits: int = 8
    group_size: int = 32
    rotated: bool = False

    def __post_init__(self) -> None:
        if self.bits not in CODED_BITS or isinstance(self.bits, bool):
            raise ValueError(f"a Quantizer codes in 8, 5, 4, 3 or 2 bits; got {self.bits!r}")
        object.__setattr__(self, "group_size", check_int("kv_group_size", self.group_size, 1))

    @property
    def levels(self) -> int:
        """The largest code."""
        return (1 << self.bits) - 1

    def groups(self, head_dim: int) -> int:
        """How many groups a head's ``head_dim`` channels form; ValueError when they do not divide evenly."""
        if head_dim % self.group_size or head_dim % PACKED_CHANNELS[self.bits]:
            raise ValueError(
                f"kv_group_size must divide the model's head_dim ({head_dim}), 4-bit codes need an even head_dim, "
                f"2-bit codes a multiple of 4 and 5- and 3-bit codes a multiple of 8; got kv_group_size="
                f"{self.group_size} with {self.bits} bits"
            )
        return head_dim // self.group_size

    def entry_bytes(self, head_dim: int, element_size: int) -> float:
        """Bytes one key or one value of ``head_dim`` channels takes: codes, and a scale and offset per group."""
        return head_dim * self.bits / 8 + 2 * self.groups(head_dim) * element_size

    def encode(self, values: torch.Tensor, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Code ``values`` ``[..., head_dim]``: ``codes`` (uint8, packed below 8 bits), and ``scales`` and
        ``offsets`` ``[..., groups]`` in ``dtype`` (by default ``values``' own)."""
        return self.encode_rotated(values, dtype)[0]

    def encode_rotated(
        self, values: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``encode``, and the values as coded, in float32: rotated when ``rotated``."""
        dtype = dtype or values.dtype
        rotated = self.as_coded(values)
        return self._encode_float(rotated, dtype, values.shape[-1]), rotated

    def as_coded(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` as this quantizer codes them: in float32, rotated when ``rotated``."""
        return rotate(values.float()) if self.rotated else values.float()

    def groups_like(self, other: Quantizer) -> bool:
        """Whether ``other`` codes in the same groups (its width and turn aside): ``encode_together`` may take both."""
        return self.group_size == other.group_size

    def encode_together(
        self, parts: list[torch.Tensor], dtype: torch.dtype, widths: list[Quantizer] | None = None
    ) -> list[dict[str, torch.Tensor]]:
        """The codes of each of ``parts`` (float32 ``[n_i, ..., head_dim]``, the same trailing shape, each already
        ``as_coded``), made in one coding pass: entries are coded each on its own, so this is what coding them apart
        gives, in about half the operators for two parts. ``widths``: the quantizer of each part where they code in
        other widths (the same group size as this one; then every part has the same shape); by default this one.

        Example:
            >>> keys, values = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
            >>> together = Quantizer(4).encode_together([keys, values], torch.float32)
            >>> all(torch.equal(together[1][name], Quantizer(4).encode(values)[name]) for name in together[1])
            True
            >>> apart = Quantizer(4).encode_together([keys, values], torch.float32, [Quantizer(5), Quantizer(4)])
            >>> all(torch.equal(apart[0][name], Quantizer(5).encode(keys)[name]) for name in apart[0])
            True
        """
        quantizers = [self] * len(parts) if widths is None else widths
        if _native.encodes(parts[0]):  # (one operator a part)
            return [_native.encode(part, quantizer.bits, quantizer.group_size, dtype)
                    for part, quantizer in zip(parts, quantizers, strict=True)]  # fmt: skip
        bits = [quantizer.bits for quantizer in quantizers]
        if len(set(bits)) == 1:
            same = self if widths is None else widths[0]
            coded = same._encode_float(torch.cat(parts), dtype, parts[0].shape[-1])
            sizes = [part.shape[0] for part in parts]
            split = {name: torch.split(tensor, sizes) for name, tensor in coded.items()}
            return [{name: pieces[index] for name, pieces in split.items()} for index in range(len(parts))]
        levels = _levels(tuple(bits), parts[0].device)
        coded = self._encode_float(torch.stack(parts), dtype, parts[0].shape[-1], levels=levels, packs=False)
        codes, scales, offsets = (coded[name].unbind(0) for name in ("codes", "scales", "offsets"))
        # The low halves, two per byte, packed once where every part below 8 bits stores them (4 and 5 bits).
        nibbles = _packed(coded["codes"], 4).unbind(0) if set(bits) <= {8, 5, 4} else None
        together = []
        for index, width in enumerate(bits):
            if width == 8:
                packed = codes[index]
            elif nibbles is None:  # 2 or 3 bits among the widths: each part packed on its own
                packed = _packed(codes[index], width)
            else:
                packed = nibbles[index] if width == 4 else torch.cat([nibbles[index], _fifth_bits(codes[index])], -1)
            together.append({"codes": packed, "scales": scales[index], "offsets": offsets[index]})
        return together

    def _encode_float(
        self,
        values: torch.Tensor,
        dtype: torch.dtype,
        head_dim: int,
        *,
        levels: torch.Tensor | None = None,
        packs: bool = True,
    ) -> dict[str, torch.Tensor]:
        """The codes, scales and offsets of ``values`` (float32, rotated already when ``rotated``); ``levels``: the
        largest code of each leading index of ``values`` (``_levels``) where it is not ``self.levels``; ``packs``:
        whether codes below 8 bits are packed (else one uint8 code per channel)."""
        if levels is None and packs and _native.encodes(values):  # (the same bytes, in one operator)
            return _native.encode(values, self.bits, self.group_size, dtype)
        grouped = values.unflatten(-1, (self.groups(head_dim), self.group_size))
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
        # The offset rounded down and the scale up in the storage dtype, so that the stored range still
        # covers every value.
        largest = self.levels if levels is None else levels.view(-1, *(1,) * (low.dim() - 1))
        offsets = _rounded(low, dtype, -math.inf)
        scales = _rounded((high - offsets.float()) / largest, dtype, math.inf)
        step = scales.float()[..., None]
        codes = ((grouped - offsets.float()[..., None]) / step.clamp(min=torch.finfo(torch.float32).tiny)).round_()
        codes = codes.clamp_(0, largest) if levels is None else codes.clamp_(min=0).clamp_(max=largest[..., None])
        codes = codes.to(torch.uint8).flatten(-2)
        if self.bits < 8 and packs:
            codes = _packed(codes, self.bits)
        return {"codes": codes, "scales": scales, "offsets": offsets}  # in this order

    def decode(
        self,
        coded: dict[str, torch.Tensor],
        dtype: torch.dtype,
        *,
        rotate_back: bool = True,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The values ``coded`` stands for, in ``dtype``; with ``rotate_back=False``, entries coded rotated
        (``rotated``) are left rotated (for attention whose queries are rotated alike: see
        ``rotary.rotated_query_columns``).

        ``out``: a tensor of the decoded shape and ``dtype`` (or a view of one) to write them into; a float32 ``out``
        is decoded in place (unless entries are rotated back), with no tensor of the decoded size made beside it."""
        codes, scales, offsets = coded["codes"], coded["scales"], coded["offsets"]
        rotates = self.rotated and rotate_back
        in_place = out is not None and out.dtype == torch.float32 and not rotates
        decoded = out if in_place else codes.new_empty((*scales.shape[:-1], self._width(codes)), dtype=torch.float32)
        self._unpack(codes, decoded)
        grouped = decoded.view(*scales.shape, -1)
        grouped.mul_(scales.float()[..., None]).add_(offsets.float()[..., None])
        if rotates:
            decoded = rotate(decoded)
        if in_place:
            return out
        if out is not None:
            return out.copy_(decoded)
        return decoded.to(dtype)

    def _width(self, codes: torch.Tensor) -> int:
        """Channels per entry of ``codes`` (``bits`` per channel)."""
        return codes.shape[-1] * 8 // self.bits

    def _unpack(self, codes: torch.Tensor, target: torch.Tensor) -> None:
        """Write the integer codes into ``target`` (float, ``[..., head_dim]``, its last dimension contiguous).

        At 4 bits each byte holds channel ``2i`` in its low half and ``2i + 1`` in its high half: widened to 16 bits
        and spread as ``low | high << 8``, its two bytes are the two codes in channel order (on a little-endian
        host), and a single conversion writes them. At 5 bits the fifth bits are put in place in those 16 bits
        before the conversion (``_spread_fifth_bits``). At 2 and 3 bits each byte's codes are shifted out
        (``_two_bit_codes``)."""
        if self.bits == 8:
            target.copy_(codes)
            return
        if self.bits < 4:
            target.copy_(_two_bit_codes(codes, target.shape[-1], self.bits))
            return
        nibbles = codes[..., : target.shape[-1] // 2]
        if self.bits == 4:
            target.copy_(_spread_nibbles(nibbles).view(torch.uint8) if _LITTLE_ENDIAN else _nibble_pairs(nibbles))
            return
        fifth = codes[..., nibbles.shape[-1] :]  # the fifth bits, eight per byte, after the low halves
        if _LITTLE_ENDIAN:
            target.copy_(_spread_nibbles(nibbles).bitwise_or_(_spread_fifth_bits(fifth)).view(torch.uint8))
        else:
            target.copy_(_nibble_pairs(nibbles))
            bit_of = _FIFTH_BIT_OF.T.to(codes.device)  # [pair, low or high code]: channel 8i + 2j + h
            target.view(*fifth.shape, 4, 2).add_((fifth[..., None, None] >> bit_of) & 1, alpha=16)


# Where a channel's fifth bit lies in its byte of fifth bits: byte ``i`` holds channels ``8i`` to ``8i + 7``, channel
# ``8i + 2j`` (the low code of pair ``j``) in bit ``j`` and channel ``8i + 2j + 1`` (the high one) in bit ``4 + j``.
# ``_FIFTH_BIT_OF[h, j]`` is the bit of pair ``j``'s low (``h = 0``) or high (``h = 1``) code.
_FIFTH_BIT_OF = torch.arange(8, dtype=torch.uint8).view(2, 4)
# Each byte's four pairs spread over four 16-bit lanes of an int64 (``_spread_fifth_bits``): the byte copied to bit
# ``15j`` puts pair ``j``'s low bit at bit 0 of lane ``j`` and its high bit at bit 4; a product then moves them to bits
# 4 and 12, the fifth bits of the lane's two codes as ``_spread_nibbles`` lays them out.
_TO_LANES = sum(1 << (15 * lane) for lane in range(4))
_LANE_BITS = sum(0x0011 << (16 * lane) for lane in range(4))
_LANE_FIFTHS = sum(0x1010 << (16 * lane) for lane in range(4))


# The channels a packed byte's codes span, by width: a head_dim must be a multiple of it.
PACKED_CHANNELS = {8: 1, 5: 8, 4: 2, 3: 8, 2: 4}
# Where each of a byte's codes lies at 2 bits (channel ``4i + j`` in bits ``2j`` and ``2j + 1``), and each of a byte's
# third bits at 3 bits (channel ``8i + j`` in bit ``j``).
_PAIR_SHIFTS = torch.arange(0, 8, 2, dtype=torch.uint8)
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _packed(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (uint8, each below ``2 ** bits``, ``[..., head_dim]``) packed: their low 4 bits two per byte (channel
    ``2i`` in the low half), then at 5 bits their fifth bits eight per byte (``_FIFTH_BIT_OF``); at 2 and 3 bits their
    low 2 bits four per byte, then at 3 bits their third bits eight per byte.

    Example:
        >>> codes = torch.tensor([1, 2, 3, 0, 7, 6, 5, 4], dtype=torch.uint8)
        >>> _packed(codes, 3).tolist(), torch.equal(_two_bit_codes(_packed(codes, 3), 8, 3), codes)
        ([57, 27, 240], True)
    """
    if bits < 4:
        pairs = ((codes & 3).unflatten(-1, (-1, 4)) << _PAIR_SHIFTS.to(codes.device)).sum(-1, dtype=torch.uint8)
        if bits == 2:
            return pairs
        third = ((codes >> 2) & 1).unflatten(-1, (-1, 8)) << _BIT_SHIFTS.to(codes.device)
        return torch.cat([pairs, third.sum(-1, dtype=torch.uint8)], dim=-1)
    low = codes & 15
    nibbles = low[..., 0::2] | (low[..., 1::2] << 4)
    if bits == 4:
        return nibbles
    return torch.cat([nibbles, _fifth_bits(codes)], dim=-1)


def _fifth_bits(codes: torch.Tensor) -> torch.Tensor:
    """The fifth bits of 5-bit ``codes`` (uint8 ``[..., head_dim]``) packed eight per byte (``_FIFTH_BIT_OF``)."""
    fifth = (codes >> 4).unflatten(-1, (-1, 4, 2)).transpose(-1, -2)  # [..., bytes, low or high code, pair]
    placed = fifth << _FIFTH_BIT_OF.to(codes.device)
    return placed.flatten(-2).sum(-1, dtype=torch.uint8)


def _spread_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit ``codes`` (two per byte) as int16, each byte widened and spread as ``low | high << 8``: on a little-endian
    host its two bytes are the two codes in channel order, so a single conversion writes them."""
    wide = codes.to(torch.int16)
    spread = wide << 4
    return spread.bitwise_or_(wide).bitwise_and_(0x0F0F)  # bits 0-3: the low code; bits 8-11: the high one


def _spread_fifth_bits(fifth: torch.Tensor) -> torch.Tensor:
    """The fifth bits (``[..., bytes]``, eight per byte) as int16 ``[..., 4 * bytes]`` to OR into ``_spread_nibbles``:
    bit 4 the low code's fifth bit, bit 12 the high one's. Five operators on an int64 per byte (four lanes)."""
    lanes = fifth.to(torch.int64).mul_(_TO_LANES).bitwise_and_(_LANE_BITS)
    return lanes.mul_(0x0110).bitwise_and_(_LANE_FIFTHS).view(torch.int16)


def _nibble_pairs(codes: torch.Tensor) -> torch.Tensor:
    """4-bit ``codes`` (two per byte) as uint8, one code per channel (any byte order)."""
    return torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)


def _two_bit_codes(codes: torch.Tensor, head_dim: int, bits: int) -> torch.Tensor:
    """2- or 3-bit ``codes`` (packed as ``_packed`` packs them) as uint8 ``[..., head_dim]``, one code per channel."""
    device = codes.device
    unpacked = ((codes[..., : head_dim // 4, None] >> _PAIR_SHIFTS.to(device)) & 3).flatten(-2)
    if bits == 3:
        third = (codes[..., head_dim // 4 :, None] >> _BIT_SHIFTS.to(device)) & 1
        unpacked |= third.flatten(-2) << 2
    return unpacked
