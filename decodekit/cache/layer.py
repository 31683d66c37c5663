"""One layer of the compressed cache: keys, values, and a running importance score per entry.

Entries are ``[batch, kv_heads, slots, head_dim]`` like transformers' ``DynamicLayer``. Every row
and KV head keeps its own set of tokens; each entry records its logical position and whether it is
live. A slot that is not live (a row's left padding, a token evicted in place, a token removed by
``crop``) is never attended to, never scored and is the first to go or to be reused.

Padding is not content: a row's budget or ratio counts that row's real tokens only, so each row
keeps what it would keep alone. Rows may then keep different numbers of tokens; the tensors stay
rectangular (as wide as the row that keeps the most, plus free slots), and the cache supplies the
attention mask that hides each row's dead slots (see ``pass_mask``).

When one token arrives and a row has a dead slot, the newcomer takes it and nothing is copied.
Decoding rows without padding instead evict ``eviction_interval`` tokens at once into reserved room
(``_append``, ``_keep``): the kept entries move to the front, the next tokens are appended after
them, and their scoring waits for the next eviction (``_score_pending``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from functools import cache
from types import ModuleType

import torch
from torch.nn import functional
from transformers.cache_utils import DynamicLayer

from decodekit.cache.policy import Allocated, EvictionPolicy
from decodekit.cache.quantize import Quantizer
from decodekit.cache.rotary import rotate


@cache
def _triton_scoring() -> ModuleType | None:
    """The Triton scoring kernels, or None where Triton is not installed."""
    try:
        import decodekit.cache._triton_scoring as kernels
    except ImportError:
        return None
    return kernels


# The per-entry tensors, [batch, kv_heads, slots, ...], as stored: the bookkeeping ones are behind the properties
# ``scores``, ``value_norms``, ``positions`` and ``live``, which bring them up to date first.
BOOKKEEPING = ("_scores", "_value_norms", "_positions", "_live")
PER_ENTRY = ("keys", "values", *BOOKKEEPING)
# With quantized storage, ``keys`` and ``values`` hold codes, and these hold each entry's group scales and offsets.
CODING = ("key_scales", "key_offsets", "value_scales", "value_offsets")
PARTS = ("keys", "values")
# Per row, with quantized storage: the key channels' magnitudes, and the last tokens' exact keys and values.
EXACT = ("key_channels", "recent_keys", "recent_values")
PROTECTED = 1.0e30  # the priority of sink and recent tokens: above any attention score
QUERY_BLOCK = 128  # observed queries scored at once
LOGIT_ELEMENTS = 1 << 25  # at most this many logits (128 MiB in float32) held at once while scoring


def rank_fractions(values: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
    """Per row and head, each entry's rank by ``values`` among the live entries (all when ``live`` is None),
    as a float64 fraction in [0, 1); dead entries get negative fractions. Ties go by slot order.

    Example:
        >>> rank_fractions(torch.tensor([[[0.3, 0.1, 0.2, 0.0]]]), torch.tensor([[[True, True, True, False]]]))
        tensor([[[ 0.6667,  0.0000,  0.3333, -0.3333]]], dtype=torch.float64)
    """
    if live is None:
        order = values.argsort(dim=-1, stable=True).argsort(dim=-1)
        return order.double() / values.shape[-1]
    count = live.sum(dim=-1, keepdim=True)
    order = torch.where(live, values.double(), -math.inf).argsort(dim=-1, stable=True).argsort(dim=-1)
    return (order - (live.shape[-1] - count)).double() / count.clamp(min=1)


@cache
def _step_tensors(steps: int, group: int, decay: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For scoring ``steps`` waiting decoding steps at once (``CompressedLayer._score_pending``): ``[steps, steps]``,
    True where step t may not see step u's token (u > t), and ``[steps, 1]``, the weight of step t's attention
    (``decay ** (steps - 1 - t)``) over the ``group`` query heads that share a KV head. Built once per shape."""
    later = torch.ones(steps, steps, dtype=torch.bool, device=device).triu_(1)
    exponents = torch.arange(steps - 1, -1, -1, dtype=torch.float64, device=device)
    return later, (decay**exponents / group).to(torch.float32)[:, None]


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


def _write(target: torch.Tensor, entry: torch.Tensor | float | bool) -> None:
    """Fill ``target`` with ``entry``: a tensor (broadcast) or one value."""
    if isinstance(entry, torch.Tensor):
        target.copy_(entry)
    else:
        target.fill_(entry)


class CompressedLayer(DynamicLayer):
    """A ``DynamicLayer`` that scores its entries by the attention they receive and evicts the least useful."""

    is_croppable = True

    def __init__(self, policy: EvictionPolicy) -> None:
        super().__init__()
        # Whether decoding steps were appended to the reserved room since the bookkeeping views last covered
        # every entry (``_append_to_prepared_room``, ``_catch_up``).
        self._lagging = False
        self.policy = policy
        self.seen = 0  # tokens given to this layer, padding included: the logical length
        self.pads: torch.Tensor | None = None  # [batch]: each row's left padding (its first pads positions)
        # Per entry, [batch, kv_heads, slots]: score, value norm, logical position, live.
        self._scores: torch.Tensor | None = None
        self._value_norms: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._live: torch.Tensor | None = None
        # Quantized storage (``policy.kv_bits``, ``policy.key_bits``): ``keys`` or ``values`` or both hold codes,
        # with each entry's group scales and offsets beside them (``CODING``); per row, the key channels' magnitudes
        # [batch, kv_heads, 1, head_dim] and the last ``recent_tokens`` tokens' exact keys and values in a
        # ring [batch, kv_heads, recent_tokens, head_dim] (in 16 bits), slot ``position % recent_tokens``, with the
        # position each ring slot holds (``recent_positions``, -1 for none).
        widths = {"keys": policy.key_bits or policy.kv_bits, "values": policy.kv_bits}
        self.quantizers = {part: Quantizer(bits, policy.kv_group_size) if bits in (4, 8) else None
                           for part, bits in widths.items()}  # fmt: skip
        self.quantized = any(quantizer is not None for quantizer in self.quantizers.values())
        self.storage_dtype: torch.dtype | None = None  # what keys, values (or their scales) are stored in
        coding = tuple(name for name in CODING if self.quantizers[name.split("_")[0] + "s"] is not None)
        self.entries = PER_ENTRY + coding
        self.key_scales = self.key_offsets = self.value_scales = self.value_offsets = None
        self.key_channels = self.recent_keys = self.recent_values = None
        self.recent_positions: torch.Tensor | None = None
        # Under allocation="global": per row, this layer's share of the tokens, ``[batch, 2]`` (count, base:
        # see ``Allocated``); None for the even share.
        self.allocated: torch.Tensor | None = None
        # Host-side bookkeeping, so that no decision needs a device read: how many live entries the
        # rows of each group hold, a group being the rows of one padding and one allocated share (a row's
        # count depends only on those and the tokens seen; beams share their request's), the least and
        # most padding of any row, and the least and most live entries of any row. Counts need not grow
        # with a row's real tokens: a decoding step's eviction takes a row below rows that have not
        # reached their target yet.
        self.live_by_group: dict[tuple[int, Allocated | None], int] = {}
        self.pad_range = (0, 0)
        self.live_range = (0, 0)
        # Decoding steps that cannot make any row go over its target (targets never shrink as tokens come),
        # so that ``compress`` skips them; 0 after anything that changes the counts.
        self._quiet_steps = 0
        # The attention module's own shape: a sliding window (a query sees the last ``sliding_window``
        # positions only) and a logit soft cap, both None for plain causal attention.
        self.sliding_window: int | None = None
        self.softcap: float | None = None
        # Reconstruction scoring: eviction waits until the prompt has been replayed (deferred), and
        # while it is replayed (replaying) an entry's score is the most attention a replay query pays it.
        self.deferred = policy.scoring == "reconstruction"
        self.replaying = False
        self._free: torch.Tensor | None = None  # [batch, kv_heads]: where this pass's one token goes
        # Slots the last in-place eviction freed, [batch, kv_heads, n], and how many of them the next
        # tokens have taken; None when unknown (a dead slot is then searched for).
        self._freed: torch.Tensor | None = None
        self._freed_taken = 0
        # While decoding with eviction_interval > 1: per-entry tensors with room for the next tokens,
        # of which the attributes above are views of the first ``slots`` entries (see ``_append``).
        self._spare: dict[str, torch.Tensor] | None = None
        # Decoding steps in the spare room whose attention is not yet in the scores: their queries with
        # their rotation (cos, sin), and the slot of the first one's token (see ``_score_pending``).
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._pending_first = 0
        self._pending_scaling = 1.0
        # The coming pass's observed tokens: the query columns of their projection, the function that makes
        # queries of them (``observer.queries_from_projection``), the scaling and their rotation (cos, sin).
        self._queries: tuple[torch.Tensor, Callable, float, torch.Tensor, torch.Tensor] | None = None
        self._to_queries: Callable[[torch.Tensor], torch.Tensor] | None = None

    # -- what the model sees ------------------------------------------------------------------------

    @property
    def scores(self) -> torch.Tensor | None:
        """Per entry, the decayed attention it has received (decoding steps not yet scored are added first)."""
        self._score_pending()
        return self._scores

    @scores.setter
    def scores(self, value: torch.Tensor | None) -> None:
        self._score_pending()
        self._scores = value

    @property
    def value_norms(self) -> torch.Tensor | None:
        """Per entry, the norm of its value vector (decoding steps not yet scored have theirs added first)."""
        self._score_pending()
        return self._value_norms

    @value_norms.setter
    def value_norms(self, value: torch.Tensor | None) -> None:
        self._value_norms = value

    @property
    def positions(self) -> torch.Tensor | None:
        """Per entry, its logical position (int32)."""
        self._catch_up()
        return self._positions

    @positions.setter
    def positions(self, value: torch.Tensor | None) -> None:
        self._positions = value

    @property
    def live(self) -> torch.Tensor | None:
        """Per entry, whether it is a token attention may see (not padding, not evicted in place, not cropped)."""
        self._catch_up()
        return self._live

    @live.setter
    def live(self, value: torch.Tensor | None) -> None:
        self._live = value

    def _catch_up(self) -> None:
        """Extend the bookkeeping views over the decoding steps appended to the reserved room since they last
        covered every entry (those steps wrote their keys and values only: the room was prepared for them)."""
        if self._lagging:
            self._lagging = False
            slots = self.slots
            for name in BOOKKEEPING:
                setattr(self, name, self._spare[name].narrow(2, 0, slots))

    @property
    def slots(self) -> int:
        """Stored entries per row and KV head, live or not."""
        return self.keys.shape[-2] if self.is_initialized else 0

    @property
    def rows(self) -> int:
        """Rows of the batch (beams included), which share a ``max_bytes`` size."""
        return self.pads.shape[0] if self.pads is not None else 1

    @property
    def kept(self) -> int:
        """The most tokens any row keeps (other rows may keep fewer)."""
        return self.live_range[1]

    def get_seq_length(self) -> int:
        """The logical length (all tokens seen), from which models derive positions."""
        return self.seen

    def _fills_free_slot(self, query_length: int) -> bool:
        """Whether a pass of ``query_length`` tokens goes into a dead slot of every row instead of a new column."""
        return query_length == 1 and self.slots > self.live_range[1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slots + (0 if self._fills_free_slot(query_length) else query_length), 0

    def begin_pass(
        self,
        query_length: int,
        pads: torch.Tensor | None = None,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor | None:
        """Prepare a forward pass of ``query_length`` tokens; return its attention mask (see ``pass_mask``).

        ``pads``, ``sliding_window`` and ``softcap`` are read on the first pass only: each row's left
        padding, and the attention module's shape (a local-attention layer, capped logits).
        """
        if not self.is_initialized:
            self.sliding_window, self.softcap = sliding_window, softcap
            if pads is None:
                raise ValueError("the first pass of a CompressedCache layer needs each row's left padding (pads)")
            self.pads = pads.to(dtype=torch.long)
            self._set_live_counts({(pads, None): 0 for pads in self.pads.unique().tolist()})
        free = None
        if self._fills_free_slot(query_length):
            if self._freed is not None and self._freed_taken < self._freed.shape[-1]:
                free = self._freed[..., self._freed_taken]
                self._freed_taken += 1
            else:
                free = (~self.live).to(torch.uint8).argmax(dim=-1)  # [batch, kv_heads]: a dead slot per row and head
        else:
            self._forget_freed()
        self._free = free
        return self.pass_mask(query_length)

    def _forget_freed(self) -> None:
        """Drop the list of freed slots (after anything that moves entries or changes which are live)."""
        self._freed, self._freed_taken = None, 0

    def observe(
        self,
        columns: torch.Tensor,
        to_queries: Callable[[torch.Tensor], torch.Tensor],
        scaling: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Receive the coming forward pass's observed (last) tokens before ``update``: their query projection's
        columns ``[batch, tokens, heads * head_dim]``, the function that makes queries ``[batch, heads, tokens,
        head_dim]`` of them, and the rotary embedding ``[batch, tokens, rotary]`` (cos, sin) that turns them."""
        self._queries = (columns, to_queries, scaling, cos, sin)

    def _rotated_queries(self, columns: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The observed tokens' queries, ``[batch, heads, tokens, head_dim]``, rotated to their positions."""
        return rotate(self._to_queries(columns), cos.unsqueeze(1), sin.unsqueeze(1))

    def pass_mask(self, query_length: int, *, plain: bool = False) -> torch.Tensor | None:
        """``[batch, kv_heads, query_length, slots]``, True where a query of the coming pass may attend.

        None when the model's own mask is right: on the first pass, and later when no row has a dead
        slot, none was padded and the layer has no sliding window (the stored layout is then the
        plain causal one), unless ``plain`` asks for the mask of that layout too (under
        ``allocation="global"`` layers differ in length, and the model's mask fits the first's).
        Queries after the first pass are real tokens; they see every live entry and the new tokens
        up to themselves.
        """
        if not self.is_initialized:
            return None
        free = self._free
        least_live = self.live_range[0] + query_length
        stored = self.slots + (0 if free is not None else query_length)
        if self.pad_range[1] == 0 and least_live >= stored and self.sliding_window is None and not plain:
            return None
        device = self.live.device
        query_positions = torch.arange(self.seen, self.seen + query_length, device=device)[:, None]
        if free is not None:
            slot = free[..., None]
            live, positions = self.live.scatter(2, slot, True), self.positions.scatter(2, slot, self.seen)
            return live[:, :, None, :] & self._in_window(positions[:, :, None, :], query_positions)
        batch, kv_heads, slots = self.live.shape
        older = self.live[:, :, None, :] & self._in_window(self.positions[:, :, None, :], query_positions)
        new_positions = query_positions.view(1, -1)
        causal = (new_positions <= query_positions) & self._in_window(new_positions, query_positions)
        older = older.expand(batch, kv_heads, query_length, slots)
        return torch.cat([older, causal.expand(batch, kv_heads, -1, -1)], dim=-1)

    def _in_window(self, positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor | bool:
        """Whether entries at ``positions`` are inside the sliding window of queries at ``query_positions``."""
        if self.sliding_window is None:
            return True
        return query_positions - positions < self.sliding_window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._queries is None:
            raise ValueError(
                "this CompressedCache received keys without the queries of their forward pass: it works only "
                "inside a forward pass of the model it was built with, whose attention modules it hooks. Pass it "
                "as past_key_values to that model's forward or generate, not to another model and not to "
                "cache.update() directly; after unbind(model), build a new CompressedCache(model, ...)"
            )
        (columns, self._to_queries, scaling, cos, sin), free = self._queries, self._free
        self._queries = self._free = None
        batch, kv_heads, new, _ = key_states.shape
        stored_as_given = not self.quantized and self.storage_dtype == key_states.dtype
        if stored_as_given and self._appends_to_prepared_room(new, free):
            # A decoding step between evictions: store the key and value; its scoring waits.
            self._append_to_prepared_room({"keys": key_states, "values": value_states})
            self._add_live(new)
            self.seen += new
            self._wait_for_scoring(columns, scaling, cos, sin)
            return self.keys, self.values
        first_pass = not self.is_initialized
        if first_pass:
            self.lazy_initialization(key_states, value_states)
            self.storage_dtype = self.dtype
            if self.policy.kv_bits is not None and self.dtype.itemsize > 2:
                self.storage_dtype = torch.float16  # 16 bits (scales at 4 and 8) in a 32-bit model
            if self.quantized:
                self._start_coding(key_states)
            empty = key_states.new_zeros((batch, kv_heads, 0), dtype=torch.float32)
            self.scores, self.value_norms = empty, empty.clone()
            self.positions = empty.to(torch.int32)
            self.live = empty.to(torch.bool)
        coded = self._code(key_states, value_states)
        if first_pass:
            for name, entry in coded.items():
                setattr(self, name, entry[:, :, :0])
        deferred = self._defers_scoring(new, free)
        if not self.replaying and not deferred:
            self.scores.mul_(self.policy.score_decay)
        if deferred and self._spare_room() >= 1:
            self._append_to_prepared_room(coded)
        else:
            self._store(coded, value_states, free, first_pass)
        if first_pass:
            self._set_live_counts({group: max(new - group[0], 0) for group in self.live_by_group})
        else:
            self._add_live(new)
        self.seen += new
        if self.quantized and not self.replaying:  # a replay's tokens are forgotten after it
            self._remember_recent(key_states, value_states)
        keys, values = self._read(key_states, value_states, free)
        if deferred:  # the step went into reserved room (kept or made anew by ``_append``)
            self._wait_for_scoring(columns, scaling, cos, sin)
            return keys, values
        received = self._attention_received(self._rotated_queries(columns, cos, sin), scaling, keys)
        if self.replaying:
            self.scores = torch.maximum(self.scores, received)
        else:
            self.scores.add_(received)
        return keys, values

    def _appends_to_prepared_room(self, new: int, free: torch.Tensor | None) -> bool:
        """Whether this pass is one decoding step whose scoring waits (``_defers_scoring``) and whose entry
        fits in the room prepared for it, so that only its key and value need writing."""
        return self._spare_room() >= 1 and self._defers_scoring(new, free)

    def _wait_for_scoring(self, columns: torch.Tensor, scaling: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Queue a decoding step's observed query columns and rotation until the next eviction scores them."""
        if not self._pending:
            self._pending_first, self._pending_scaling = self.slots - 1, scaling
        self._pending.append((columns, cos, sin))

    def _add_live(self, new: int) -> None:
        """Count ``new`` more live entries in every row (a pass appended or filled a slot in each)."""
        self.live_by_group = {group: live + new for group, live in self.live_by_group.items()}
        least, most = self.live_range
        self.live_range = (least + new, most + new)

    # -- quantized storage ----------------------------------------------------------------------------

    def _start_coding(self, key_states: torch.Tensor) -> None:
        """On the first pass: measure each key channel's magnitude over the rows' real tokens, and make the
        ring of exact recent entries."""
        batch, kv_heads, new, head_dim = key_states.shape
        if self.quantizers["keys"] is not None:
            real = torch.arange(new, device=key_states.device) >= self.pads[:, None]  # [batch, new]
            magnitude = torch.where(real[:, None, :, None], key_states.float().abs(), 0.0).amax(dim=2, keepdim=True)
            self.key_channels = magnitude.clamp_(min=1e-6)
        ring = self.policy.recent_tokens
        self.recent_keys = key_states.new_zeros((batch, kv_heads, ring, head_dim), dtype=self.storage_dtype)
        self.recent_values = torch.zeros_like(self.recent_keys)
        self.recent_positions = torch.full((ring,), -1, dtype=torch.int32, device=key_states.device)

    def _code(self, key_states: torch.Tensor, value_states: torch.Tensor) -> dict[str, torch.Tensor]:
        """What a pass's keys and values store as: themselves (in 16 bits with ``kv_bits=16``), or their codes,
        scales and offsets."""
        coded = {}
        for part, states in zip(PARTS, (key_states, value_states), strict=True):
            quantizer = self.quantizers[part]
            if quantizer is None:
                coded[part] = self._in_storage_dtype(states)
                continue
            if part == "keys":
                states = states.float() / self.key_channels
            codes = quantizer.encode(states, self.storage_dtype)
            prefix = part[:-1]
            coded[part], coded[f"{prefix}_scales"], coded[f"{prefix}_offsets"] = codes.values()
        return coded

    def _in_storage_dtype(self, states: torch.Tensor) -> torch.Tensor:
        """``states`` in the storage dtype; a 32-bit value beyond float16's range is held at its largest."""
        dtype = self.storage_dtype
        if states.dtype == dtype:
            return states
        limit = torch.finfo(dtype).max
        return states.clamp(-limit, limit).to(dtype)

    def _remember_recent(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Keep the exact keys and values of the pass's last tokens (up to the ring's size) in the ring."""
        ring = self.recent_keys.shape[2]
        count = min(key_states.shape[2], ring)
        positions = torch.arange(self.seen - count, self.seen, device=key_states.device, dtype=torch.int32)
        slots = (positions % ring).long()
        self.recent_keys.index_copy_(2, slots, self._in_storage_dtype(key_states[:, :, -count:]))
        self.recent_values.index_copy_(2, slots, self._in_storage_dtype(value_states[:, :, -count:]))
        self.recent_positions.index_copy_(0, slots, positions)

    def _read(self, key_states: torch.Tensor, value_states: torch.Tensor, free) -> tuple[torch.Tensor, torch.Tensor]:
        """What this pass's attention reads: the stored entries (``dense``), with the pass's own tokens exact
        (they were stored after ``free`` slots' or after the others)."""
        keys, values = self.dense()
        if keys is self.keys:  # stored as they are
            return keys, values
        if free is None:
            new = key_states.shape[2]
            keys[:, :, -new:], values[:, :, -new:] = key_states, value_states
        else:
            slot = free[..., None, None].expand(-1, -1, 1, keys.shape[-1])
            keys.scatter_(2, slot, key_states)
            values.scatter_(2, slot, value_states)
        return keys, values

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored keys and values in the cache's dtype, ``[batch, kv_heads, slots, head_dim]``, as attention
        reads them: with quantized storage, decoded, the entries still in the ring exact; with ``kv_bits=16`` in a
        32-bit model, cast back."""
        if not self.quantized:
            if self.storage_dtype == self.dtype:
                return self.keys, self.values
            return self.keys.to(self.dtype), self.values.to(self.dtype)  # 16-bit storage of a 32-bit model
        keys, values = (self._decoded(part) for part in PARTS)
        # The ring's tokens are the latest positions: find the slots of the last ``ring`` positions and, where
        # the ring still holds that position (a crop or replay may have overwritten it), read it exact.
        ring = self.recent_keys.shape[2]
        latest = self.positions.topk(min(ring, self.slots), dim=-1).indices  # [batch, kv_heads, ring]
        latest_positions = self.positions.gather(2, latest)
        ring_slot = (latest_positions % ring).long()
        held = (self.recent_positions[ring_slot] == latest_positions)[..., None]
        head_dim = keys.shape[-1]
        into, out_of = latest[..., None].expand(-1, -1, -1, head_dim), ring_slot[..., None].expand(-1, -1, -1, head_dim)
        for decoded, recent in ((keys, self.recent_keys), (values, self.recent_values)):
            exact = recent.gather(2, out_of).to(self.dtype)
            decoded.scatter_(2, into, torch.where(held, exact, decoded.gather(2, into)))
        return keys, values

    def _decoded(self, part: str) -> torch.Tensor:
        """The stored ``part`` ("keys" or "values") decoded to the cache's dtype (ring aside)."""
        stored, quantizer = getattr(self, part), self.quantizers[part]
        if quantizer is None:
            return stored.to(self.dtype, copy=True)  # a copy: the ring's entries are written into it
        prefix = part[:-1]
        codes = {
            "codes": stored,
            "scales": getattr(self, f"{prefix}_scales"),
            "offsets": getattr(self, f"{prefix}_offsets"),
        }
        decoded = quantizer.decode(codes, torch.float32)
        if part == "keys":
            decoded = decoded.mul_(self.key_channels)
        return decoded.to(self.dtype)

    def _defers_scoring(self, new: int, free: torch.Tensor | None) -> bool:
        """Whether this pass's scoring waits for the next eviction: one decoding step appended to the spare
        room of a layer whose queries see every entry (no padding, no window, no cap, no pooling), while
        fewer than ``eviction_interval`` steps wait. Anything else first scores the waiting steps."""
        deferred = (
            new == 1 and free is None and self._spare is not None and self.pad_range[1] == 0
            and self.sliding_window is None and self.softcap is None and self.policy.pool_kernel == 1
            and not self.replaying and self.live_range[0] == self.slots
            and len(self._pending) < self.policy.eviction_interval  # a row under its target evicts nothing
        )  # fmt: skip
        if not deferred:
            self._score_pending()
        return deferred

    def _score_pending(self) -> None:
        """Add the attention of the waiting decoding steps to the scores, as one step at a time would.

        Step ``t`` of ``m`` (its token in slot ``first + t``) saw the slots before its own and itself;
        a step decays every score by ``score_decay`` before adding its attention, so older scores are
        decayed ``m`` times and step ``t``'s attention ``m - 1 - t`` times. Entries appended during the
        steps start from 0.
        """
        self._catch_up()
        pending = self._pending
        if not pending:
            return
        self._pending = []
        columns, cos, sin = (torch.cat(parts, dim=1) for parts in zip(*pending, strict=True))
        queries = self._rotated_queries(columns, cos, sin)  # [batch, heads, steps, head_dim]
        steps, first, decay = queries.shape[2], self._pending_first, self.policy.score_decay
        keys, values = self.dense()
        batch, kv_heads, _, head_dim = keys.shape
        visible = first + steps
        group = queries.shape[1] // kv_heads
        grouped = queries.to(keys.dtype).reshape(batch, kv_heads, group * steps, head_dim)
        logits = torch.matmul(grouped, keys[:, :, :visible].transpose(-1, -2)).float()
        logits = logits.mul_(self._pending_scaling).view(batch, kv_heads, group, steps, visible)
        later, weights = _step_tensors(steps, group, decay, logits.device)
        logits[..., first:].masked_fill_(later, -math.inf)  # step t sees the steps' tokens up to its own
        received = logits.softmax(dim=-1).mul_(weights).sum(dim=(2, 3))
        self._scores[:, :, :visible].mul_(decay**steps).add_(received)
        self._value_norms[:, :, first:visible] = values[:, :, first:visible].float().norm(dim=-1)

    def _has_spare(self) -> bool:
        """Whether the per-entry tensors are views of larger ones (spare room, possibly all used)."""
        spare = self._spare
        if spare is not None and any(getattr(self, name)._base is not spare[name] for name in self.entries):
            self._spare = spare = None  # the tensors were replaced (rows reordered, a replay...)
        return spare is not None

    def _store(self, coded: dict[str, torch.Tensor], value_states: torch.Tensor, free, first_pass: bool) -> None:
        """Store a pass's entries (``coded``: keys and values as stored, see ``_code``): one token into each
        row's ``free`` slot, or after the stored entries."""
        batch, kv_heads, new, _ = value_states.shape
        positions = torch.arange(self.seen, self.seen + new, device=value_states.device, dtype=torch.int32)
        positions = positions.expand(batch, kv_heads, new)
        value_norms = value_states.float().norm(dim=-1)
        if free is not None:
            self._fill(free, coded, value_norms, positions)
            return
        live = positions >= self.pads[:, None, None] if first_pass else True
        entries = {**coded, "_scores": 0.0, "_value_norms": value_norms, "_positions": positions, "_live": live}
        self._append(entries, first_pass)

    def _spare_room(self) -> int:
        """How many entries fit after the stored ones without moving them (0 without spare room)."""
        return self._spare["keys"].shape[2] - self.slots if self._has_spare() else 0

    def _append(self, entries: dict[str, torch.Tensor | float | bool], first_pass: bool) -> None:
        """Store ``entries`` (a tensor, or one value for every new entry) after the stored ones: in spare
        room when it fits, else in new tensors.

        One decoding step with ``eviction_interval > 1`` reserves room for the steps up to the next
        eviction (never beyond ``budget + 1`` slots), so that those steps copy one entry each
        instead of the whole layer.
        """
        self._catch_up()
        new, stored = entries["keys"].shape[2], 0 if first_pass else self.slots
        if self._spare_room() >= new:
            for name, entry in entries.items():
                base = self._spare[name]
                _write(base.narrow(2, stored, new), entry)
                setattr(self, name, base.narrow(2, 0, stored + new))
            return
        self._spare = None
        interval = self.policy.eviction_interval
        capacity = stored + new
        reserve = not first_pass and new == 1 and interval > 1 and self.pad_range[1] == 0
        if reserve:
            capacity += interval - 1
            fixed = self._fixed_target()
            if fixed is not None:
                capacity = max(stored + new, min(capacity, fixed + 1))
        spare = {}
        batch, kv_heads = entries["keys"].shape[:2]
        for name, entry in entries.items():
            old = getattr(self, name)
            trailing = entry.shape[3:] if isinstance(entry, torch.Tensor) else ()
            base = old.new_empty((batch, kv_heads, capacity, *trailing))
            if stored:
                base.narrow(2, 0, stored).copy_(old)
            _write(base.narrow(2, stored, new), entry)
            spare[name] = base
            setattr(self, name, base.narrow(2, 0, stored + new))
        if reserve:  # kept even when full: the next eviction moves the kept entries to its front
            self._spare = spare
            self._prepare_room(stored + new, self.seen + new)

    def _prepare_room(self, filled: int, next_position: int) -> None:
        """Give the spare room's entries, from slot ``filled`` on, what the next tokens will have: live,
        score 0, consecutive positions from ``next_position``. Their keys, values and value norms come
        with them (``_append_to_prepared_room``, ``_score_pending``)."""
        room = self._spare["keys"].shape[2] - filled
        if room <= 0:
            return
        self._spare["_live"].narrow(2, filled, room).fill_(True)
        self._spare["_scores"].narrow(2, filled, room).zero_()
        positions = torch.arange(next_position, next_position + room, dtype=torch.int32, device=self.keys.device)
        self._spare["_positions"].narrow(2, filled, room).copy_(positions)

    def _append_to_prepared_room(self, coded: dict[str, torch.Tensor]) -> None:
        """One decoding step whose scoring waits: only its key and value (as stored) are written, and only their
        views extended; the bookkeeping views follow when read (``_catch_up``)."""
        stored = self.slots
        for name, entry in coded.items():
            base = self._spare[name]
            base.narrow(2, stored, 1).copy_(entry)
            setattr(self, name, base.narrow(2, 0, stored + 1))
        self._lagging = True

    def _fill(self, free, coded, value_norms, positions) -> None:
        slot = free[..., None]
        for name, entry in coded.items():
            getattr(self, name).scatter_(2, slot[..., None].expand(-1, -1, -1, entry.shape[-1]), entry)
        self.scores.scatter_(2, slot, 0.0)
        self.value_norms.scatter_(2, slot, value_norms)
        self.positions.scatter_(2, slot, positions)
        self.live.scatter_(2, slot, True)

    def _keep(self, index: torch.Tensor) -> None:
        """Keep the entries at ``index`` ([batch, kv_heads, n] slots), in that order (at the front of the
        spare room's tensors when there is one)."""
        self._forget_freed()
        self._score_pending()
        in_place = self._has_spare()
        count, by_width = index.shape[2], {}  # by_width: ``index`` over a last dimension of that width
        for name in self.entries:
            tensor = getattr(self, name)
            along = index
            if tensor.dim() == 4:
                width = tensor.shape[-1]
                if width not in by_width:
                    by_width[width] = index[..., None].expand(-1, -1, -1, width)
                along = by_width[width]
            kept = tensor.gather(2, along)
            if in_place:
                kept = self._spare[name].narrow(2, 0, count).copy_(kept)
            setattr(self, name, kept)
        if in_place:
            self._prepare_room(index.shape[2], self.seen)

    def kept_positions(self) -> torch.Tensor:
        """The logical positions of the live tokens, ``[batch, kv_heads, kept]``, increasing.

        A row that keeps fewer tokens than ``kept`` (more padding, a smaller ratio target) is
        filled with -1 at the front, as a left-padded batch is.
        """
        if not self.is_initialized:
            return torch.zeros(0, 0, 0, dtype=torch.int32)
        positions = self.positions.masked_fill(~self.live, -1).sort(dim=-1).values
        return positions[..., positions.shape[-1] - self.kept :]

    # -- scoring and eviction -------------------------------------------------------------------------

    def _attention_received(self, queries: torch.Tensor, scaling: float, keys: torch.Tensor) -> torch.Tensor:
        """Mean attention each entry gets from the observed queries (the last ones) that can see it.

        Computed per KV head (averaged over the query heads that share it) in blocks of queries,
        exactly (a softmax per query over every entry it sees), without materializing more than
        one block of logits. When the new tokens were appended, a block needs only the slots
        before its last query. With no padding, no dead entry and no sliding window, only the
        block's own diagonal needs a causal mask; otherwise visibility follows logical positions
        and liveness. Left-padding queries (first pass only) see padding only, so they give real
        entries nothing. ``keys`` are the stored keys as attention reads them (``dense``).
        """
        batch, kv_heads, slots, head_dim = keys.shape
        window, group = queries.shape[2], queries.shape[1] // kv_heads
        appended = window > 1  # a pass of several tokens is appended; one token may fill a free slot
        unmasked = self.pad_range[1] == 0 and self.live_range[0] == slots and self.sliding_window is None
        if window == 1 and unmasked and not self.replaying and self.softcap is None and self.policy.pool_kernel == 1:
            # One decoding step that sees every entry: logits in the cache's dtype, as eager attention
            # computes them, then a float32 softmax per query head, averaged over the group.
            grouped = queries.to(keys.dtype).reshape(batch, kv_heads, group, head_dim)
            logits = torch.matmul(grouped, keys.transpose(-1, -2))  # [batch, kv_heads, group, slots]
            return logits.float().mul_(scaling).softmax(dim=-1).mean(dim=2)
        causal_only = appended and unmasked
        if causal_only and self.softcap is None and not self.replaying and self._on_triton():
            received = _triton_scoring().attention_received(queries.to(keys.dtype), keys, scaling)
            return self._per_query(received, window, group)
        grouped = (queries.float() * scaling).reshape(batch, kv_heads, group, window, head_dim)
        keys_t = keys.float().transpose(-1, -2)[:, :, None]  # [batch, kv_heads, 1, head_dim, slots]
        first_slot, first_position = slots - window, self.seen - window
        received = grouped.new_zeros((batch, kv_heads, slots))
        block = max(1, min(QUERY_BLOCK, LOGIT_ELEMENTS // (batch * kv_heads * group * slots)))
        for start in range(0, window, block):
            stop = min(start + block, window)
            visible = first_slot + stop if appended else slots
            logits = torch.matmul(grouped[:, :, :, start:stop], keys_t[..., :visible])  # [b, h, g, w, t]
            if self.softcap is not None:
                logits.div_(self.softcap).tanh_().mul_(self.softcap)
            if causal_only:
                diagonal = logits[..., first_slot + start : visible]
                diagonal += torch.full(diagonal.shape[-2:], -math.inf, device=logits.device).triu_(1)
            else:
                logits.masked_fill_(self._hidden(first_position + start, first_position + stop, visible), -math.inf)
            logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
            # Normalize each query's row and sum over the queries in one product: (1 / row sums) @ exp.
            if self.replaying:  # the most attention any replay query pays each entry
                logits.div_(logits.sum(dim=-1, keepdim=True))
                received[..., :visible] = torch.maximum(received[..., :visible], logits.amax(dim=(2, 3)))
                continue
            inverse = logits.sum(dim=-1).reciprocal_().reshape(batch, kv_heads, 1, -1)
            rows = logits.reshape(batch, kv_heads, -1, visible)
            received[..., :visible] += torch.matmul(inverse, rows).squeeze(2)
        if self.replaying:
            return received
        return self._per_query(received, window, group)

    def _per_query(self, received: torch.Tensor, window: int, group: int) -> torch.Tensor:
        """Attention summed over the observed queries and a KV head's group, as a mean per query that sees
        each entry, smoothed over neighbours when the policy says so."""
        batch, kv_heads, slots = received.shape
        # How many observed queries see each entry: entries among the new tokens are seen by fewer,
        # and under a sliding window so are entries that leave it.
        last_seer = self.seen
        if self.sliding_window is not None:
            last_seer = (self.positions + self.sliding_window).clamp(max=self.seen)
        seen_by = (last_seer - self.positions.clamp(min=self.seen - window)).clamp(min=1) * group
        received = received / seen_by
        kernel = self.policy.pool_kernel
        if kernel > 1:
            flat = received.reshape(batch * kv_heads, 1, slots)
            received = functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
            received = received.reshape(batch, kv_heads, slots)
        return received

    def _on_triton(self) -> bool:
        """Whether this layer's scores run on the Triton kernels (see ``scoring_backend``)."""
        backend = self.policy.scoring_backend
        if backend == "torch":
            return False
        if backend == "auto":
            return self.keys.is_cuda and _triton_scoring() is not None
        if _triton_scoring() is None:
            raise ValueError("scoring_backend='triton' needs the triton package (pip install triton)")
        if not self.keys.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"scoring_backend='triton' needs the cache on a CUDA device; it is on {self.keys.device}: "
                "use scoring_backend='auto' or 'torch'"
            )
        return True

    def _hidden(self, first_query: int, stop_query: int, visible: int) -> torch.Tensor:
        """``[batch, kv_heads, 1, queries, visible]``: True where a query at a position in
        [first_query, stop_query) may not see an entry among the first ``visible`` slots."""
        query_position = torch.arange(first_query, stop_query, device=self.positions.device)[:, None]
        entry_position = self.positions[:, :, None, None, :visible]
        dead = ~self.live[:, :, None, None, :visible]
        hidden = (entry_position > query_position) | (dead & (query_position >= self.pads[:, None, None, None, None]))
        if self.sliding_window is not None:
            hidden |= query_position - entry_position >= self.sliding_window
        return hidden

    def priority_scores(self) -> torch.Tensor:
        """The entries' scores as eviction ranks them: times the value norm when the policy says so
        (``EvictionPolicy.ranks_by_value_norm``)."""
        return self.scores * self.value_norms if self.policy.ranks_by_value_norm else self.scores

    def set_priority(self, priority: torch.Tensor) -> None:
        """Store scores such that ``priority_scores()`` returns ``priority``."""
        self.scores = priority / self.value_norms.clamp(min=1e-30) if self.policy.ranks_by_value_norm else priority

    def _priority(self) -> torch.Tensor:
        """Sinks and recent tokens above every score, then score (times value norm); under a sliding
        window, tokens no later query can see go first."""
        pads = self.pads[:, None, None] if self.pad_range[1] else 0
        protected = (self.positions < pads + self.policy.sink_tokens) | (
            self.positions >= self.seen - self.policy.recent_tokens
        )
        scores = self.priority_scores()
        if self.policy.scoring == "attention+novelty":
            scores = self._with_novelty(scores)
        priority = torch.where(protected, PROTECTED, scores)
        if self.sliding_window is not None:
            priority = torch.where(self.positions <= self.seen - self.sliding_window, -PROTECTED, priority)
        return priority

    def _with_novelty(self, attention: torch.Tensor) -> torch.Tensor:
        """Each live entry's better rank, as a fraction of the live entries, under ``attention`` and under the
        novelty of its key (negative cosine similarity to the row and head's mean live key, as KeyDiff
        ranks); ties go by the other rank, then by attention. Float64; dead entries rank lowest."""
        live = self.live
        count = live.sum(dim=-1, keepdim=True)
        keys = self.dense()[0].float()
        mean = (keys * live[..., None]).sum(dim=-2, keepdim=True) / count[..., None].clamp(min=1)
        novelty = -functional.cosine_similarity(keys, mean, dim=-1)
        by_attention, by_novelty = rank_fractions(attention, live), rank_fractions(novelty, live)
        better, worse = torch.maximum(by_attention, by_novelty), torch.minimum(by_attention, by_novelty)
        return better + worse * 2.0**-20 + by_attention * 2.0**-40

    def compress(self, new: int) -> None:
        """Evict each row down to its target, after a pass of ``new`` tokens; reuse slots where possible.

        A row over its target (real tokens seen) keeps its sinks and recent tokens, then the best
        ranked, up to the target, or after one decoding step up to the target less
        ``eviction_interval - 1`` (``EvictionPolicy.kept``): the next steps then fill the freed slots
        and evict nothing. When the spare slots per row are no more than that, evicted entries are
        only marked dead (the next tokens take the slots); otherwise the storage shrinks to the row
        that keeps the most.
        """
        if self.deferred:
            return
        if new == 1 and self._quiet_steps > 0:
            self._quiet_steps -= 1
            return
        self._evict(new)
        self._quiet_steps = self._steps_without_eviction()

    def _steps_without_eviction(self) -> int:
        """How many decoding steps from now can evict nothing: the least room under its target of any row
        (targets never shrink as tokens come), when the stored slots are few enough that such a step
        reshapes nothing; else 0."""
        if self.slots - self.live_range[1] > 1 + self.policy.slack(1):
            return 0
        rows, seen = self.rows, self.seen
        room = [
            self.policy.target(seen - pads, rows, allocated) - live
            for (pads, allocated), live in self.live_by_group.items()
        ]
        return max(min(room), 0) if room else 0

    def _evict(self, new: int) -> None:
        """``compress``'s work when a row may be over its target."""
        slack = self.policy.slack(new)
        before = self.live_by_group
        rows = self.rows
        after = {
            (pads, allocated): self.policy.kept(live, self.seen - pads, slack, rows, allocated)
            for (pads, allocated), live in before.items()
        }
        self._set_live_counts(after)
        uniform = len(before) == 1  # one group: every row holds the same entries
        bound = max(before[group] - after[group] for group in before)  # the most any row evicts
        keep_most = self.live_range[1]
        in_place = self.slots - keep_most <= 1 + slack
        if bound == 0 and in_place:
            return
        if uniform and self._has_spare():
            # Decoding with spare room: keep the best-ranked entries at the front, in order; the next
            # tokens go after them without a mask for dead slots.
            priority = self._priority()
            if self.live_range[0] < self.slots:  # a row holds dead slots
                priority = torch.where(self.live, priority, -math.inf)
            self._keep(priority.topk(keep_most, dim=-1).indices.sort(dim=-1).values)
            return
        if uniform and in_place:
            # Every row drops its ``bound`` lowest-ranked entries, in place; the next tokens take their slots.
            victims = torch.where(self.live, self._priority(), math.inf).topk(bound, dim=-1, largest=False).indices
            self.live.scatter_(2, victims, False)
            self._freed, self._freed_taken = victims, 0
            return
        self._forget_freed()
        live_count = self.live[:, :1].sum(dim=-1, keepdim=True)  # [batch, 1, 1]: the same for every head
        allocated = self.allocated[:, None, None] if self.allocated is not None else None
        keep = self.policy.kept_counts(live_count, (self.seen - self.pads)[:, None, None], slack, rows, allocated)
        priority = self._priority()
        if in_place:
            # Mark the lowest-ranked live entries dead, in place.
            lowest = torch.where(self.live, priority, math.inf).topk(bound, dim=-1, largest=False)
            rank = torch.arange(bound, device=priority.device)
            stays = self.live.gather(2, lowest.indices) & (rank < (live_count - keep)).logical_not()
            self.live.scatter_(2, lowest.indices, stays)
            return
        ranked = torch.where(self.live, priority, -math.inf).topk(keep_most, dim=-1).indices
        stays = torch.arange(keep_most, device=priority.device) < keep
        index, order = ranked.sort(dim=-1)
        self._keep(index)
        self.live &= stays.expand_as(order).gather(2, order)

    # -- batch bookkeeping (beam search, assisted generation) -------------------------------------

    def _per_row(self) -> tuple[str, ...]:
        return (*self.entries, "pads", "allocated", *EXACT)

    def _apply_to_rows(self, operation) -> None:
        """Apply a row operation (select, reorder, repeat) to every per-row tensor; with reserved room, to
        the whole room, so that beam search keeps it (its prepared entries are the same in every row)."""
        self._score_pending()
        self._forget_freed()
        self._quiet_steps = 0  # a new batch of rows may share max_bytes differently
        names = self._per_row()
        if self._has_spare():
            slots = self.slots
            for name in self.entries:
                self._spare[name] = operation(self._spare[name])
                setattr(self, name, self._spare[name].narrow(2, 0, slots))
            names = names[len(self.entries) :]
        for name in names:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, operation(tensor))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder rows for beam search (beams move within their request, so the padding ranges hold)."""
        if self.is_initialized:
            self._apply_to_rows(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._apply_to_rows(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._apply_to_rows(lambda tensor: tensor[indices.to(tensor.device)])
            self._recount()

    def _set_live_counts(self, live_by_group: dict[tuple[int, Allocated | None], int]) -> None:
        """Record each group's live count, the least and most padding, and the least and most count."""
        self.live_by_group = live_by_group
        self._quiet_steps = 0
        pads, counts = [group[0] for group in live_by_group], live_by_group.values()
        self.pad_range = (min(pads), max(pads)) if live_by_group else (0, 0)
        self.live_range = (min(counts), max(counts)) if live_by_group else (0, 0)

    def _recount(self) -> None:
        """Read the paddings, shares and live counts back from the device (after a change the host cannot follow)."""
        columns = [self.pads, self.live[:, 0].sum(dim=-1)]
        if self.allocated is not None:
            columns += [self.allocated[:, 0], self.allocated[:, 1]]
        values = torch.stack(columns).T.tolist()
        self._set_live_counts({(row[0], tuple(row[2:]) or None): row[1] for row in values})

    def allocate(self, counts: list[int], bases: list[int]) -> None:
        """Give each row its own share of the tokens: ``counts[row]`` kept per KV head where an even share
        keeps ``bases[row]`` (``allocation="global"``); the eviction that follows applies it."""
        if len(counts) != self.rows or len(bases) != self.rows:
            raise ValueError(f"allocate needs one count and one base per row ({self.rows}); got {counts}, {bases}")
        self.allocated = torch.tensor([counts, bases], dtype=torch.long, device=self.pads.device).T.contiguous()
        live = {pads: count for (pads, _), count in self.live_by_group.items()}
        groups = zip(self.pads.tolist(), counts, bases, strict=True)
        self._set_live_counts({(pads, (count, base)): live[pads] for pads, count, base in groups})

    def _fixed_target(self) -> int | None:
        """The most tokens any row keeps when the target does not grow with the tokens seen, else None."""
        fixed = self.policy.fixed_target(self.rows)
        if fixed is None or self.allocated is None:
            return fixed
        return max(self.policy.target(0, self.rows, allocated) for _, allocated in self.live_by_group)

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens seen (candidate tokens rejected by assisted generation).

        The newest tokens are always held (they are in the recent window), so this undoes their
        pass exactly, except that the attention they paid to older tokens stays in those tokens'
        scores, and anything their pass evicted stays evicted.
        """
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative number of tokens to remove (as DynamicLayer does); got {tokens_to_remove}"
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._score_pending()
        self.seen = max(self.seen + tokens_to_remove, 0)
        self.live &= self.positions < self.seen
        self._forget_freed()
        self._spare = None  # its room was prepared for the positions after the forgotten tokens
        self._recount()

    def drop_dead(self) -> None:
        """Free the slots of dead entries when every row and head holds the same number of live ones."""
        least, most = self.live_range
        if least != most or self.slots == most:
            return
        order = torch.argsort((~self.live).to(torch.uint8), dim=-1, stable=True)[..., :most]
        self._keep(order)

    def reset(self) -> None:
        super().reset()
        self._pending = []
        self._scores = self.value_norms = self.positions = self.live = self.pads = self.allocated = None
        for name in (*CODING, *EXACT, "recent_positions"):
            setattr(self, name, None)
        self._queries = self._free = None
        self._spare = None
        self._lagging = False
        self._forget_freed()
        self.sliding_window = self.softcap = None
        self.deferred, self.replaying = self.policy.scoring == "reconstruction", False
        self._set_live_counts({})
        self.seen = 0

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds: keys, values and per-entry bookkeeping (with the reserved room and
        dead slots behind them), the rows' padding, freed-slot lists and the waiting decoding steps'
        queries with their rotation."""
        held = [getattr(self, name) for name in (*self._per_row(), "recent_positions", "_freed", "_free")]
        if self._spare is not None:
            held.extend(self._spare.values())
        held.extend(part for step in self._pending for part in step)
        if self._queries is not None:
            held.extend(part for part in self._queries if isinstance(part, torch.Tensor))
        return [tensor for tensor in held if isinstance(tensor, torch.Tensor)]

    def memory_bytes(self) -> int:
        """Bytes of every storage behind :meth:`held_tensors`, each counted once (a view holds its whole storage)."""
        return sum(storage_bytes(self.held_tensors()).values())
