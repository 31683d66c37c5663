"""One layer of the compressed cache: what transformers and the attention observer talk to.

A layer owns its parts and talks to them through their public methods: the ``EntryStorage`` (one for every row and
KV head, each with its own length), the coding (plain or quantized), the scorer (``scorers/``), the
``EvictionPolicy`` (how many tokens each row keeps) and, for the first layers under reconstruction scoring, the
attention matching that refits what the prompt keeps (``matching.py``).

A forward pass goes ``begin_pass`` (the mask it needs), ``observe`` (its queries, from the observer), ``update``
(its keys and values stored; what attention reads returned) and ``end_pass`` (scored, then evicted).
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

import decodekit.cache._native as _native
import decodekit.cache.attention as attention
import decodekit.cache.compiled as compiled
import decodekit.cache.matching as matching
from decodekit.cache.eviction import PROTECTED, best_in_slot_order, lowest, protect, removal_moves
from decodekit.cache.fused_step import FusedSteps
from decodekit.cache.joint import Eviction, LayerGroup
from decodekit.cache.policy import EvictionPolicy
from decodekit.cache.quantize import hadamard, rotation_block
from decodekit.cache.received import Visibility, uses_triton
from decodekit.cache.rotary import rotate
from decodekit.cache.storage import Allocate, EntryStorage, Field, own_tensor, storage_bytes

BIAS_DTYPE = torch.float16  # a refit entry's log-mass bias: 2 bytes (``size.BIAS_BYTES``)
# An eviction moves the newest entries into the victims' slots while at most this share of a segment goes (few
# entries move); past it, the kept entries are packed in slot order.
MOVES_AT_MOST = 0.5


@dataclass
class Pass:
    """One forward pass through a layer, from ``begin_pass`` to ``end_pass``.

    ``columns`` are the observed (last) queries' projection columns, ``to_queries`` makes queries ``[batch, heads,
    tokens, head_dim]`` of them, ``cos`` and ``sin`` rotate them. ``update`` adds what attention read (``keys``,
    ``values``) and where the pass's tokens went (``new_slots``: the slot of the first, for every segment or per
    segment ``[batch, heads]``).
    """

    new: int
    first: bool
    columns: torch.Tensor | None = None
    to_queries: Callable[[torch.Tensor], torch.Tensor] | None = None
    scaling: float = 1.0
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    new_slots: torch.Tensor | int = 0
    received: torch.Tensor | None = None  # what a decoding step's own attention paid each entry, when the layer read it
    waits: bool = False  # whether its scoring waits for the next eviction (the scorer's ``may_wait``)
    group: int = 1  # query heads per KV head, where the layer read the step's attention itself
    reads_itself: bool = False  # whether the layer computes the step's attention itself (``attention.py``)
    kernel: Callable | None = None  # the step_attention it reads the entries with (None: decoded in PyTorch)
    fused: bool = False  # whether the step runs as one operator (``fused_step.py``) when its attention is read
    read: bool = False  # whether a fused step's attention was read (and the step run)

    def queries(self) -> torch.Tensor:
        """The observed tokens' queries, rotated to their positions: ``[batch, heads, tokens, head_dim]``."""
        return rotate(self.to_queries(self.columns), self.cos.unsqueeze(1), self.sin.unsqueeze(1))


class CompressedLayer(CacheLayerMixin):
    """A cache layer that scores its entries and keeps each row and KV head within its target.

    Args:
        options: the cache's resolved options (``options.ResolvedOptions``).
        policy: how many tokens each row keeps.
        scorer: this layer's scorer (a class of ``scorers.SCORERS``, made for this layer).
        coding: how this layer stores keys and values (``coding.PlainCoding`` or ``coding.QuantizedCoding``).
        matched: whether the prompt's kept entries are refit when it is evicted (``matching.py``).
    """

    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(
        self,
        options,
        policy: EvictionPolicy,
        scorer,
        coding,
        *,
        matched: bool = False,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.options, self.policy, self.scorer, self.coding = options, policy, scorer, coding
        self.matched = matched
        self.storage: EntryStorage | None = None
        # Tokens given to this layer, padding included (the logical length): on the host, and on the device for compiled
        # steps (the same memory on a CPU; on CUDA kept current by every pass and read back after compiled steps).
        self._seen = np.zeros((), dtype=np.int64)
        self.seen_device: torch.Tensor | None = None
        self._seen_stale = False
        # Whether the storage keeps one capacity while decoding (a size fixed in tokens or bytes, not "heads"): what
        # compiled steps need.
        self.static_capacity = policy.fixed_target() is not None and options.size.allocation != "heads"
        self.pads: np.ndarray | None = None  # host [batch]: each row's left padding (and on the device: pads_device)
        self.padded = False  # whether some row has left padding
        self.pads_device: torch.Tensor | None = None
        # Until its first eviction a padded batch holds its padding in place, as DynamicCache does (so that attention
        # reads what it reads there): each row's first ``held_pads`` slots, never scored or counted.
        self.held_pads: np.ndarray | None = None
        self._padding_held = False
        # The attention module's sliding window and logit cap. A windowed layer holds at most ``window - 1`` tokens,
        # as transformers' own cache holds (``cap``), and evicts at every step, so that it never holds a token its
        # window has passed.
        self.window, self.softcap = window, softcap
        self.cap = None if window is None else window - 1
        self.interval = 1 if window is not None else policy.interval
        self.dtype: torch.dtype | None = None
        self.head_dim = 0
        self.shares: tuple[np.ndarray, np.ndarray] | None = None  # host counts [batch, heads], bases [batch]
        self.biased = False  # whether refit entries carry log-mass biases (``matching.py``)
        self.transient = False  # whether the passes' tokens are forgotten after them (a replay)
        self.waits_for_prompt_scores = False  # whether eviction waits for the prompt's scores (a replay)
        self.context_start = 0  # the tokens seen before the last pass (where a piece of context read in it starts)
        # Whether passes of several tokens still read the context (until the first decoding step, or ``end_context``):
        # a scorer that replays replays each of them.
        self.reads_context = True
        self.prompt_queries: Pass | None = None  # the prompt's pass, kept for the refit of a matched layer
        self._pass: Pass | None = None
        self.module: weakref.ref | None = None  # the attention module this layer serves (``attention.answers``)
        # Decoding steps from now that cannot take a row over its target (targets never shrink as tokens come): their
        # eviction check is skipped. And the slots after every segment's entries whose position, score (and bias) the
        # next steps' tokens will have, written by the last eviction: those steps write their keys and values alone.
        self._quiet_steps = 0
        self._prepared: tuple[int, int] | None = None  # (the storage's keys tensor id, the first slot not prepared)
        self._fused: FusedSteps | None = None  # the plan of the next decoding steps run as one operator each
        # The cache's layers evicted together while decoding (``joint.py``), and where this layer's decoding storage
        # comes from (a slice of tensors shared with the group's other layers, where it reads entries in place).
        self.group: LayerGroup | None = None

    def join(self, group: LayerGroup) -> None:
        """Evict with ``group``'s other layers while decoding (``joint.py``)."""
        self.group = group

    def _allocator(self) -> Allocate:
        """Where this layer's decoding storage comes from: slices of tensors shared with its group's other layers,
        where entries are read in place (plain, in the model's dtype) and can be evicted together."""
        if self.group is None or self.window is not None or not self.coding.reads_in_place():
            return own_tensor
        return self.group.allocator(self)

    def _settle(self) -> None:
        """Make the group's waiting evictions, left by a pass that stopped before its last layer."""
        if self.group is not None and self.group.due:
            self.group.evict_due()

    def __deepcopy__(self, memo: dict) -> CompressedLayer:
        """A deep copy whose device count of tokens seen is its own count's memory again (as on a CPU)."""
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        for name, value in vars(self).items():
            setattr(copied, name, value if name == "module" else copy.deepcopy(value, memo))
        if self.seen_device is not None and self.seen_device.device.type == "cpu":
            copied.seen_device = torch.from_numpy(copied._seen)
        return copied

    # -- what transformers asks -------------------------------------------------------------------------------------

    @property
    def is_compileable(self) -> bool:
        """Whether ``generate`` may compile decoding steps: one eviction per step under a budget in tokens."""
        return self.policy.keeps_one_room()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """(The storage is made by the first pass, which knows each row's padding.)"""

    @property
    def seen(self) -> int:
        """Tokens given to this layer, padding included: the logical length (read back after compiled steps)."""
        if self._seen_stale:
            self._seen_stale = False
            self._seen[...] = int(self.seen_device)
        return int(self._seen)

    @seen.setter
    def seen(self, value: int) -> None:
        _ = self.seen  # (read back first: a count the device changed is overwritten now, not read back over this one)
        self._seen[...] = value
        if self.seen_device is not None and self.seen_device.device.type != "cpu":
            self.seen_device.fill_(value)

    def mark_host_stale(self) -> None:
        """Note that a compiled step counted on the device alone (on CUDA): read the count back when next needed; the
        host's plans for the next eager steps (quiet steps, prepared slots) no longer hold."""
        self._quiet_steps = 0
        self._prepared = None
        self._fused = None
        if self.seen_device.device.type != "cpu":
            self._seen_stale = True

    def get_seq_length(self) -> int | torch.Tensor:
        """The logical length (every token seen), from which models derive positions: inside a compiled step, the
        count on the device (as transformers' StaticLayer returns its own)."""
        if torch.compiler.is_compiling() and self.seen_device is not None:
            return self.seen_device
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The keys attention reads in a pass of ``query_length`` tokens: the longest segment, plus the pass (inside a
        compiled step: the whole capacity, which holds the step's token)."""
        if torch.compiler.is_compiling() and self.storage is not None:
            return self.storage.capacity, 0
        return self.longest + query_length, 0

    @property
    def longest(self) -> int:
        """The most entries any row and head holds."""
        return self.storage.length_range[1] if self.storage is not None else 0

    @property
    def kept(self) -> int:
        """The most tokens any row keeps in any head (padding never counts)."""
        if self.storage is None:
            return 0
        if not self.padding_held:
            return self.longest
        return int((self.storage.lengths_host - self.held_pads[:, None]).max())

    @property
    def rows(self) -> int:
        """Rows of the batch (beams included), which share a ``max_bytes`` size."""
        return self.storage.batch if self.storage is not None else 1

    @property
    def scores_on_triton(self) -> bool:
        """Whether this layer's scores run on the Triton kernels (``scoring_backend``)."""
        return self.storage is not None and uses_triton(self.options.scoring.backend, self.storage.device)

    # -- a forward pass ---------------------------------------------------------------------------------------------

    def begin_pass(
        self,
        query_length: int,
        pads: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Prepare a pass of ``query_length`` tokens; return the attention mask it needs, ``[batch, heads,
        query_length, keys]`` (boolean, or float logit offsets where entries carry biases), or None where the
        model's own mask is right. ``pads`` (each row's left padding) is read on the first pass only."""
        if torch.compiler.is_compiling():
            self._pass = Pass(query_length, False)
            return compiled.begin(self, query_length)
        first = self.storage is None
        if self.group is not None and self.group.due and self is self.group.layers[0]:
            self._settle()
        if first:
            if pads is None:
                raise ValueError("the first pass of a CompressedCache layer needs each row's left padding (pads)")
            self._set_pads(pads.to("cpu", torch.long).numpy().copy())
            self.held_pads = self.pads.copy()
            self._padding_held = bool(self.pads.any())
        if query_length == 1 and self._fused is not None and not self.transient:  # (planned: read by the layer)
            self._pass = Pass(1, False, reads_itself=True)
            self.context_start, self.reads_context = self.seen, False
            return None
        self._fused = None  # (a pass of several tokens: the plan no longer holds)
        self._pass = step = Pass(query_length, first)
        if not self.transient:  # (a replay's passes are none of these)
            self.context_start = 0 if first else self.seen
            if query_length == 1:
                self.reads_context = False  # a decoding step: the context is complete
            elif self.reads_context and not first and self.scorer.replays:
                self.waits_for_prompt_scores = True  # a further piece of context: replayed once read, then evicted
        if first:
            return None
        step.reads_itself = self._reads_itself(step)
        if step.reads_itself or not self.needs_mask(query_length):
            return None  # (a step the layer reads itself makes its own mask: ``_read_mask``)
        return self.pass_mask(query_length)

    @property
    def reads_step_itself(self) -> bool:
        """Whether the coming pass is a decoding step whose attention this layer computes itself."""
        return self._pass is not None and self._pass.reads_itself

    def needs_mask(self, query_length: int) -> bool:
        """Whether the coming pass needs a mask of its own: rows or heads of different lengths, a padded batch (the
        model's mask follows the padded sequence, not the stored entries), a sliding window, or biased entries."""
        dropped = self.padded and not self.padding_held  # the padded layout is gone
        return not self.storage.equal_lengths or dropped or self.window is not None or self.biased

    @property
    def padding_held(self) -> bool:
        """Whether some row still holds its left padding in place (before the layer's first eviction)."""
        return self._padding_held

    def _set_pads(self, pads: np.ndarray) -> None:
        self.pads = pads
        self.padded = bool(pads.any())  # whether some row has left padding
        self.pads_device = torch.from_numpy(pads).to(self.storage.device if self.storage else "cpu")

    def pass_mask(self, query_length: int) -> torch.Tensor:
        """The coming pass's mask (see ``begin_pass``): each query sees every stored entry of its row and head
        (within its window) and the pass's tokens up to its own, which go after each segment's entries."""
        storage = self.storage
        columns = self.longest + query_length
        slot = torch.arange(columns, device=storage.device)
        lengths = storage.lengths[..., None, None]  # [batch, heads, 1, 1]
        query = torch.arange(query_length, device=storage.device)[:, None]
        visible = slot <= lengths + query  # stored entries, then the pass's tokens up to the query's own
        if self.padding_held:
            visible &= slot >= self.pads_device[:, None, None, None]  # (held padding: the row's own)
        if self.window is not None:
            stored = slot < lengths
            positions = storage.read("positions", columns).long()[:, :, None, :]
            query_position = self.seen + query
            own_position = self.seen + slot - lengths
            position = torch.where(stored, positions, own_position)
            visible &= query_position - position < self.window
        if not self.biased:
            return visible
        biases = storage.read("biases", columns).float()
        biases = torch.where(slot < storage.lengths[..., None], biases, 0.0)[:, :, None, :]
        return torch.where(visible, biases, -math.inf)

    def observe(
        self,
        columns: torch.Tensor,
        to_queries: Callable[[torch.Tensor], torch.Tensor],
        scaling: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Receive the coming pass's observed (last) tokens: their query projection's columns ``[batch, tokens,
        heads * head_dim]``, what makes queries of them, the attention scaling and their rotary embedding."""
        step = self._pass
        if step is not None:
            step.columns, step.to_queries, step.scaling, step.cos, step.sin = columns, to_queries, scaling, cos, sin

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store a pass's keys and values; return what attention reads, ``[batch, heads, keys, head_dim]``."""
        step = self._pass
        if step is None or step.columns is None:
            raise ValueError(
                "this CompressedCache received keys without the queries of their forward pass: it works only "
                "inside a forward pass of the model it was built with, whose attention modules it observes. Pass it "
                "as past_key_values to that model's forward or generate, not to another model and not to "
                "cache.update() directly; after unbind(model), build a new CompressedCache(model, ...)"
            )
        if torch.compiler.is_compiling():
            keys, values = compiled.update(self, step, key_states, value_states)
            step.keys, step.values = keys, values
            return keys, values
        fused = self._fused
        if fused is not None and step.reads_itself and fused.holds(self):
            return self._update_fused(step, key_states, value_states)
        batch, heads, new, _ = key_states.shape
        if self.storage is None:
            self._start(key_states)
        storage = self.storage
        step.waits = self.scorer.may_wait(self, step)
        if step.waits and self._writes_prepared_slot(step):
            return self._update_prepared(step, key_states, value_states)
        if step.reads_itself:  # (a decoding step)
            step.kernel = self._step_kernel()
            if self._codes_step_natively(step):  # its key and value coded into the storage by one C++ operator
                if storage.free_slots < 1:  # (every segment given its room at once: one layout for all of them)
                    storage.reserve(storage.lengths_host + 1 + self._room(), 0, self._allocator())
                if not step.waits and step.kernel is _native.step_attention and self._plans_fused():
                    return self._update_fused(step, key_states, value_states)
                if step.waits:  # (where the waiting steps begin, for the scorer)
                    step.new_slots = storage.length_range[0] if storage.equal_lengths else storage.lengths.clone()
                others = {name: 0.0 for name in ("scores", "biases") if name in storage.fields}
                if not step.waits:  # (a waiting step's value norm is taken when it is scored)
                    others.update(self.scorer.new_entries(value_states))
                read_keys = self.coding.append_step(storage, key_states, value_states, self.seen, others)
                self._seen += 1
                attention.expect(id(self.module()), partial(self._attend, step, read_keys, value_states))
                return read_keys, value_states
        fields, read_keys = self.coding.encode(key_states, value_states)
        seen = self.seen
        equal = storage.equal_lengths
        step.new_slots = storage.length_range[0] if equal else storage.lengths.clone()
        entries = fields
        prepared = new == 1 and equal and self._is_prepared(step.new_slots)
        quantized = self.coding.quantized and not self.transient
        positions = None  # (a prepared step's positions are stored already)
        if not prepared or quantized:
            positions = torch.arange(seen, seen + new, dtype=torch.int32, device=key_states.device)
        if not prepared:
            entries = {**fields, "positions": positions.expand(batch, heads, new), "scores": 0.0}
            if "biases" in storage.fields:
                entries["biases"] = 0.0
        if not step.waits:  # (a waiting step's value norm is taken when it is scored)
            entries = {**entries, **self.scorer.new_entries(value_states)}
        grows = new == 1 and storage.free_slots < 1  # (some segment grows)
        if grows:
            storage.append(entries, 1, room=self._room(), allocate=self._allocator())
        else:
            storage.append(entries, new)
        self._count_seen(new)
        if grows and not self.transient:
            self._prepare_steps()  # (the steps into the new room write their keys and values alone)
        if quantized:
            self.coding.remember(read_keys, value_states, positions)
        if step.first:
            keys, values = read_keys, value_states  # the pass's own tokens, exact
        elif step.reads_itself:
            attention.expect(id(self.module()), partial(self._attend, step, read_keys, value_states))
            return read_keys, value_states  # (the module's attention call comes back to ``_attend``)
        elif self.coding.reads_in_place():
            keys, values = storage.read("keys"), storage.read("values")
        else:
            keys, values = self.coding.decode(storage, self.longest)
            self._write_pass_exact(keys, values, read_keys, value_states, step.new_slots)
        step.keys, step.values = keys, values
        return keys, values

    def _writes_prepared_slot(self, step: Pass) -> bool:
        """Whether a decoding step whose scoring waits writes its key and value alone (``_update_prepared``): plain
        entries that attention reads in place, every segment of one length with its next slot prepared."""
        storage = self.storage
        return (
            self._prepared is not None and not step.reads_itself and not self.transient and not self.coding.quantized
            and storage.takes_step() and self._is_prepared(storage.length_range[0]) and self.coding.reads_in_place()
        )  # fmt: skip

    def _update_prepared(self, step: Pass, key_states: torch.Tensor, value_states: torch.Tensor):
        """``update`` of a decoding step into prepared slots (``_writes_prepared_slot``): what the step-by-step path
        does there, without its checks: the key and value written, counted, and read in place."""
        storage = self.storage
        step.new_slots = storage.length_range[0]
        keys, values = storage.append_step(key_states, value_states)
        self._count_seen(1)
        step.keys, step.values = keys, values
        return keys, values

    def _count_seen(self, new: int) -> None:
        """Count ``new`` tokens given to this layer, on the host and on an accelerator's copy for compiled steps (on a
        CPU the copy is the host's memory)."""
        self._seen += new
        if self.seen_device is not None and self.seen_device.device.type != "cpu":
            self.seen_device.add_(new)

    def _plans_fused(self) -> bool:
        """Whether the coming decoding step, and the next ones, run as one operator each (``fused_step.py``): planned
        now."""
        self._fused = FusedSteps.plan(self)
        return self._fused is not None

    def _update_fused(self, step: Pass, key_states: torch.Tensor, value_states: torch.Tensor):
        """``update`` of a step that runs as one operator when the module reads its attention (``_attend_fused``)."""
        rows, read_keys = self.coding.step_rows(key_states)
        entries = {}
        if self._fused.value_norms is not None:  # (the entry's fields other than its score, which is 0)
            entries = {name: value for name, value in self.scorer.new_entries(value_states).items()
                       if isinstance(value, torch.Tensor)}  # fmt: skip
        if self.coding.residual_length:
            self.coding.remember(read_keys, value_states, torch.tensor([self.seen], dtype=torch.int32))
        self._seen += 1
        self._quiet_steps, self._prepared = 0, None  # (the plan evicts; the step-by-step plans start again after it)
        step.fused = True
        attention.expect(id(self.module()), partial(self._attend_fused, step, rows, read_keys, value_states, entries))
        return read_keys, value_states

    def _attend_fused(self, step: Pass, rows, read_keys, values, entries, query, scaling, model_mask) -> torch.Tensor:
        """The attention of a step that runs as one operator: the step itself (its entry stored, its attention,
        scores and eviction)."""
        step.read = True
        return self._fused.step(self, query, scaling, rows, read_keys, values, entries)

    def _codes_step_natively(self, step: Pass) -> bool:
        """Whether a decoding step's key and value go into the storage through ``coding.append_step`` (one C++
        operator): a step the layer reads itself with a kernel that reads the codes where they lie, keys and values
        coded alike."""
        return (
            step.kernel is not None and not self.transient and self.coding.quantized
            and self.coding.appends_steps_natively(self.storage)
        )  # fmt: skip

    def _is_prepared(self, slot: int) -> bool:
        """Whether ``slot`` (of every segment) holds the position, score (and bias) of the next token already."""
        prepared = self._prepared
        return prepared is not None and prepared[0] == id(self.storage.flat["keys"]) and slot < prepared[1]

    def _prepare_steps(self) -> None:
        """Write the position, score 0 (and bias 0) of the next ``eviction_interval`` tokens into the free slots after
        every segment's entries (all of one length), so that the decoding steps until the next eviction write their
        keys and values alone: after an eviction, a pass of several tokens, or a step that grew the storage."""
        storage = self.storage
        self._prepared = None
        if not (storage.rectangular and storage.equal_lengths) or self.padding_held:
            return
        start = storage.length_range[0]
        room = min(self.policy.interval, storage.capacity - start)
        if room <= 0:
            return
        positions = torch.arange(self.seen, self.seen + room, dtype=torch.int32, device=storage.device)
        for name, value in (("positions", positions), ("scores", 0.0), ("biases", 0.0)):
            if name in storage.fields:
                target = storage.tensor(name).narrow(2, start, room)
                target.copy_(value) if isinstance(value, torch.Tensor) else target.fill_(value)
        self._prepared = (id(storage.flat["keys"]), start + room)

    def _reads_itself(self, step: Pass) -> bool:
        """Whether this decoding step's attention reads the entries where they lie (``attention.py``): entries that
        attention cannot read as they are (codes, 16-bit storage of a wider model, heads of their own lengths), and
        an attention module whose calls reach decodekit's wrapper. Not a replayed token (``transient``): its scorer
        reads every entry as attention read it."""
        if step.new != 1 or self.transient or (self.coding.reads_in_place() and self.storage.rectangular):
            return False
        module = self.module() if self.module is not None else None
        return module is not None and attention.answers(module)

    def _read_mask(self, stop: int) -> torch.Tensor | None:
        """What a decoding step the layer reads itself may see among each segment's first ``stop`` slots, its own
        token included, ``[batch, heads, 1, stop]``: boolean, or logit offsets where entries carry biases; None where
        it sees every slot."""
        storage = self.storage
        if storage.equal_lengths and not self.padding_held and self.window is None and not self.biased:
            return None
        slot = torch.arange(stop, device=storage.device)
        visible = slot < storage.lengths[..., None]
        if self.padding_held:
            visible &= slot >= self.pads_device[:, None, None]
        if self.window is not None:
            visible &= self.seen - 1 - storage.read("positions", stop) < self.window
        visible = visible[:, :, None, :]
        if not self.biased:
            return visible
        return torch.where(visible, storage.read("biases", stop).float()[:, :, None, :], -math.inf)

    def _attend(self, step: Pass, read_keys, value_states, query, scaling, model_mask) -> torch.Tensor:
        """The step's attention over every stored entry, its own token exact: on the Triton kernels where they apply
        (``_triton_attention.py``: the codes read where they lie), else over the entries decoded; its probabilities
        kept for the scorer."""
        step_attention = step.kernel
        if step_attention is not None:
            coding = self.coding
            widths = tuple(None if q is None else q.bits for q in coding.quantizers.values()) if coding.quantized \
                else (None, None)  # fmt: skip
            extra = {"residual": coding.residual_window()} if coding.quantized and coding.residual_length else {}
            if coding.quantized and coding.smoothing:
                extra["key_means"] = coding.read_key_means()
            output, step.received = step_attention(
                query, self.storage, widths, self.options.storage.group_size, read_keys, value_states, scaling,
                softcap=self.softcap, biased=self.biased, window=self.window, query_position=self.seen - 1, **extra,
            )  # fmt: skip
            step.group = query.shape[1] // self.storage.heads
            return output
        keys, values = self.coding.decode(self.storage, self.longest, dtype=torch.float32)
        self._write_pass_exact(keys, values, read_keys, value_states, step.new_slots)
        mask = self._read_mask(self.longest)
        output, step.received = attention.read_decoded(query, keys, values, scaling, mask, self.softcap)
        step.keys, step.values, step.group = keys, values, query.shape[1] // self.storage.heads
        return output

    def _step_kernel(self) -> Callable | None:
        """The ``step_attention`` that reads this layer's entries where they lie for its decoding steps, where one
        applies (no padding held, keys read as coded): the Triton kernels on CUDA with Triton installed
        (``scoring_backend`` "auto") or when told so ("triton"), without a residual window; the C++ operator on a
        CPU where it builds ("auto"); None: decode the entries in PyTorch."""
        backend = self.options.scoring.backend
        coding = self.coding
        keys_read_as_coded = not coding.quantized or coding.quantizers["keys"] is None or coding.rotated_reads
        if backend == "torch" or not keys_read_as_coded or self.padding_held:
            return None
        device = self.storage.device
        residual = coding.quantized and coding.residual_length > 0
        if uses_triton(backend, device):
            if residual:
                return None
            from decodekit.cache._triton_attention import step_attention

            return step_attention
        if backend == "auto" and _native.runs_on(device):
            return _native.step_attention
        return None

    def _room(self) -> int:
        """Slots a segment that must grow for a decoding step gets beyond it: room for the steps until the next
        eviction (``EvictionPolicy.growth_room``), never past the most a fixed target holds (its target and the
        step's token)."""
        room = self.policy.growth_room()
        fixed = self.policy.fixed_target(self.rows)
        if fixed is not None and self.shares is None:
            fixed = fixed if self.cap is None else min(fixed, self.cap)
            room = max(min(room, fixed - self.longest), 0)
        return room

    def fit_capacity(self) -> None:
        """After a pass of several tokens: give each segment room for the decoding steps until its next eviction
        and no more (a fixed target's segments at most its target and one step's token), freeing the rest; a cache
        that evicts at every step under a budget in tokens (what compiled steps run) holds that whole room at once,
        as transformers' StaticCache holds ``max_cache_len``."""
        storage = self.storage
        lengths = storage.lengths_host
        if self.policy.keeps_one_room():  # compiled steps' one room: the target and a step's token, as StaticCache
            wanted = np.maximum(self.targets() + 1, lengths)
        elif self.policy.fixed_target(self.rows) is not None:  # room for the steps until the next eviction
            wanted = np.maximum(np.minimum(lengths + self.interval, self.targets() + 1), lengths)
        else:
            wanted = lengths + self.policy.growth_room()
        if self.shares is None or self.options.size.allocation != "heads":
            wanted = np.full_like(wanted, wanted.max())
        storage.resize(wanted, self._allocator())

    def compiled_target(self) -> int | torch.Tensor:
        """A compiled step's target: the fixed size, or per row and head under a shared allocation (a tensor)."""
        if self.shares is None:
            fixed = self.policy.fixed_target(self.storage.batch)
            return fixed if self.cap is None else min(fixed, self.cap)
        return self._device_targets

    def _start(self, key_states: torch.Tensor) -> None:
        """The first pass: make the storage for its rows and heads."""
        batch, heads, new, head_dim = key_states.shape
        self.dtype, self.head_dim = key_states.dtype, head_dim
        self.coding.start(key_states, self.pads)
        if self.static_capacity:
            device_count = torch.from_numpy(self._seen)
            self.seen_device = device_count if key_states.is_cuda is False else device_count.to(key_states.device)
        self.storage = EntryStorage(self._fields(head_dim), batch, heads, new, key_states.device)
        self._set_pads(self.pads)

    def _fields(self, head_dim: int) -> dict[str, Field]:
        """What the storage holds per entry: the coding's fields, the position, the scorer's and a refit's bias."""
        fields = {**self.coding.fields(head_dim), "positions": Field((), torch.int32), **self.scorer.fields()}
        if self.matched:
            fields["biases"] = Field((), BIAS_DTYPE)
        return fields

    def _write_pass_exact(self, keys, values, read_keys, value_states, new_slots) -> None:
        """Write the pass's own keys (as attention reads them) and values, exact, where they were stored."""
        new = read_keys.shape[2]
        if isinstance(new_slots, int):
            keys[:, :, new_slots : new_slots + new] = read_keys
            values[:, :, new_slots : new_slots + new] = value_states
            return
        index = (new_slots[..., None] + torch.arange(new, device=keys.device))[..., None].expand(-1, -1, -1,
                                                                                               keys.shape[-1])
        keys.scatter_(2, index, read_keys.to(keys.dtype))
        values.scatter_(2, index, value_states.to(values.dtype))

    def end_pass(self, query_length: int) -> None:
        """After attention: score the pass, and evict (after a pass of several tokens, fit the storage's capacity)."""
        step, self._pass = self._pass, None
        if step is not None and step.fused:  # (the operator did the rest)
            if not step.read:
                self._read_missed()
            if self.group is not None:
                self.group.after_pass(self)
            return
        if step is None or (step.keys is None and step.received is None and not self._read_missed()):
            return
        if torch.compiler.is_compiling():
            compiled.end(self, step)
            return

        self.scorer.after_pass(self, step)
        if step.first and self.matched:
            self.prompt_queries = step  # refit against at the prompt's eviction
        if not (self.transient or self.waits_for_prompt_scores):
            eviction = self.eviction_due(query_length)
            deferred = eviction is not None and query_length == 1 and self.group is not None \
                and self.group.defer(self, eviction)  # fmt: skip
            if eviction is not None and not deferred:
                self.evict_now(eviction)
            if self.group is not None and query_length == 1:
                self.group.after_pass(self)  # (the last layer's pass evicts the layers that wait)
            if query_length > 1:
                if self.padding_held and self.policy.keeps_one_room():
                    self._drop_padding()  # (compiled steps need it gone: their capacity holds real entries only)
                self.fit_capacity()
                self._prepare_steps()

    def _drop_padding(self) -> None:
        """Drop each row's held left padding (its first ``held_pads`` slots, before any eviction)."""
        self._forget_plans()
        storage = self.storage
        length = storage.length_range[1]
        pads = self.held_pads
        slots = self.pads_device[:, None, None] + torch.arange(length - int(pads.min()), device=storage.device)
        kept = np.repeat((length - pads)[:, None], storage.heads, axis=1)
        storage.keep(slots.clamp(max=length - 1).expand(-1, storage.heads, -1), kept)
        self.held_pads = np.zeros_like(pads)
        self._padding_held = False

    def forget_last(self, count: int) -> None:
        """Forget the last ``count`` tokens of a transient pass (a replayed chunk): they were just appended."""
        self._forget_plans()
        self.storage.truncate(count)
        self.seen -= count

    # -- reads for the parts ----------------------------------------------------------------------------------------

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored key and value as attention reads them, ``[batch, heads, longest, head_dim]``."""
        return self.coding.decode(self.storage, self.longest)

    def rotated_queries(self, queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``queries`` ``[batch, heads, tokens, head_dim]`` rotated by their rotary embedding ``[batch, tokens, -]``."""
        return rotate(queries, cos.unsqueeze(1), sin.unsqueeze(1))

    def visibility(self, step: Pass) -> Visibility:
        """What the pass's observed queries may see among the entries attention read (``step.keys``)."""
        storage = self.storage
        columns = step.keys.shape[2]
        observed = step.columns.shape[1]
        first_query = self.seen - observed
        positions = storage.read("positions", columns)
        padded = self.padding_held
        appended = storage.equal_lengths and not padded and self.window is None
        valid = None
        if not step.first and not appended:
            valid = storage.valid(columns)
        if padded:
            real = positions >= self.pads_device[:, None, None]
            valid = real if valid is None else valid & real
        pads = self.pads_device if padded else None
        return Visibility(positions, first_query, valid, pads, self.window, appended=appended)

    def biases(self, step: Pass) -> torch.Tensor | None:
        """The log-mass biases of the entries attention read in ``step`` (0 for the pass's own), or None."""
        return self.stored_biases(step.keys.shape[2])

    def stored_biases(self, stop: int, valid: torch.Tensor | None = None) -> torch.Tensor | None:
        """``[batch, heads, stop]`` float32: the biases of each segment's first ``stop`` slots (0 past its entries),
        or None where no entry carries one."""
        if not self.biased:
            return None
        biases = self.storage.read("biases", stop).float()
        return torch.where(self.storage.valid(stop) if valid is None else valid, biases, 0.0)

    def positions(self) -> torch.Tensor:
        """``[batch, heads, longest]`` int32: each slot's logical position, -1 past a segment's entries."""
        storage = self.storage
        positions = storage.read("positions", self.longest)
        valid = storage.valid(self.longest)
        if self.padding_held:
            valid &= positions >= self.pads_device[:, None, None]
        return torch.where(valid, positions, -1)

    def scores(self) -> torch.Tensor:
        """``[batch, heads, longest]`` float32: each entry's score (waiting steps scored first), 0 past its entries."""
        self.scorer.flush(self)
        storage = self.storage
        return torch.where(storage.valid(self.longest), storage.read("scores", self.longest), 0.0)

    def kept_positions(self) -> torch.Tensor:
        """The logical positions of the kept tokens, ``[batch, heads, kept]``, increasing; a row or head that keeps
        fewer is filled with -1 at the front, as a left-padded batch is."""
        if self.storage is None:
            return torch.zeros(0, 0, 0, dtype=torch.int32)
        return self.positions().sort(dim=-1).values

    # -- eviction -------------------------------------------------------------------------------------------------

    def targets(self) -> torch.Tensor:
        """Host ``[batch, heads]``: how many tokens each row and head may keep now."""
        return self._targets_at(self.seen - self.pads)

    def targets_ahead(self, steps: int) -> np.ndarray:
        """Host ``[steps, batch, heads]``: ``targets`` once each of the next ``steps`` decoding steps' token is seen."""
        return self._targets_at((self.seen - self.pads)[None, :] + np.arange(1, steps + 1)[:, None])

    def _targets_at(self, real: np.ndarray) -> np.ndarray:
        """Host ``[..., batch, heads]``: the targets of each row and head at ``real`` (``[..., batch]``) tokens seen."""
        row_targets = self.policy.targets(real.reshape(-1), self.rows, self.cap).reshape(real.shape)
        if self.shares is None:
            return np.repeat(row_targets[..., None], self.storage.heads, axis=-1)
        shared = self.policy.shared(row_targets, *self.shares)
        return shared if self.cap is None else np.minimum(shared, self.cap)

    def priority(self, stop: int) -> torch.Tensor:
        """``[batch, heads, stop]``: the rank of each entry for eviction: the sinks and recent tokens above every
        score, then the scorer's importance, under a sliding window the tokens no query can see below all."""
        size = self.options.size
        pads = self.pads_device[:, None, None] if self.pads.any() else 0
        positions = self.storage.read("positions", stop)
        importance = self.scorer.importance(self, stop)
        return protect(importance, positions, self.seen, size.sink_tokens, size.recent_tokens, pads, self.window)

    def evict(self, new: int) -> None:
        """Keep each row and head within its target after a pass of ``new`` tokens: a row over it keeps the
        best-ranked entries, down to the target (after a decoding step, down to the target less the eviction interval
        less one, so that the next steps evict nothing)."""
        eviction = self.eviction_due(new)
        if eviction is not None:
            self.evict_now(eviction)

    def eviction_due(self, new: int) -> Eviction | None:
        """The eviction a pass of ``new`` tokens calls for (see ``evict``), or None where every row is within its
        target (the steps that cannot take a row over it are then counted, and skip this check)."""
        if new == 1 and self._quiet_steps > 0:
            self._quiet_steps -= 1
            return None
        lengths = self.storage.lengths_host - self.held_pads[:, None]  # (real entries: padding never counts)
        targets = self.targets()
        keep = self.policy.kept_counts(lengths, targets, new, self.interval)
        drops = lengths - keep
        most = int(drops.max())
        if most == 0:
            self._quiet_steps = int((targets - lengths).min())
            return None
        return Eviction(targets, keep, drops, most)

    def evicts_together(self) -> bool:
        """Whether this layer's decoding-step eviction may be made with the group's other layers (``joint.py``):
        plain entries read in place, one length for every row and head, moves of a few entries, and nothing a
        layer does alone (held padding, a sliding window, biases, a refit, the scorer's own flush)."""
        storage = self.storage
        return (
            storage.rectangular and storage.equal_lengths and not self.padding_held and self.window is None
            and not self.biased and self.prompt_queries is None and self.coding.reads_in_place()
            and self.scorer.flushes_together and not torch.compiler.is_compiling()
        )  # fmt: skip

    def moves_few(self, eviction: Eviction) -> bool:
        """Whether ``eviction`` frees its slots by moving a few entries (the rest stay where they are), rather than
        packing every kept entry."""
        return eviction.most <= MOVES_AT_MOST * self.longest

    def evicted_together(self, eviction: Eviction, prepared_until: int | None) -> None:
        """After the group evicted this layer (``joint.py``) and wrote the next steps' positions and scores up to slot
        ``prepared_until`` (None: not written): plan the next steps as ``evict_now`` does."""
        self._quiet_steps = int((eviction.targets - eviction.keep).min())
        self._prepared = None if prepared_until is None else (id(self.storage.flat["keys"]), prepared_until)

    def evict_now(self, eviction: Eviction) -> None:
        """Make ``eviction`` (``eviction_due``'s): each row and head keeps its best-ranked entries."""
        storage = self.storage
        targets, keep, drops, most = eviction.targets, eviction.keep, eviction.drops, eviction.most
        self.scorer.flush(self)
        if self.padding_held:
            self._drop_padding()
        prompt = self.matched and self.prompt_queries is not None
        before = tuple(part.clone() for part in self.decoded()) if prompt else None  # (the eviction moves entries)
        longest = self.longest
        if self.moves_few(eviction):  # few go: the last entries of each segment move into their slots
            ranked = self.natively_ranked() if most == 1 and not prompt else None
            if ranked is not None:  # (one a segment: one C++ operator)
                self._evict_one_natively(drops, ranked)
            else:
                victims = lowest(self.priority(longest), storage.valid(longest), most)
                sources, destinations, lanes = removal_moves(victims, storage.lengths, self._on_device(drops))
                storage.move(sources, destinations, lanes)
            storage.set_lengths(keep)
        else:
            priority, valid = self.priority(longest), storage.valid(longest)
            storage.keep(best_in_slot_order(priority, valid, int(keep.max()), self._on_device(keep)), keep)
        if prompt:
            self._refit(before)
        self._quiet_steps = int((targets - keep).min())
        self._prepare_steps()

    def natively_ranked(self) -> tuple[str, ...] | None:
        """The fields an eviction of one entry a segment ranks by where it runs as one C++ operator
        (``_native.evict_one``): on a CPU where it is built, for a scorer that ranks by its scores (times the values'
        norms), as ``priority`` does; None elsewhere."""
        ranked = self.scorer.ranked_fields()
        return ranked if ranked is not None and ranked[0] == "scores" and _native.runs_on(self.storage.device) \
            else None  # fmt: skip

    def _evict_one_natively(self, drops: np.ndarray, ranked: tuple[str, ...]) -> None:
        """``evict_now``'s one entry a segment, where ``drops[b, h]`` is 1: the lowest ``priority`` by the fields
        ``ranked`` goes, the segment's last entry takes its slot (the caller sets the lengths)."""
        storage, size = self.storage, self.options.size
        flat = storage.flat
        _native.evict_one(
            list(flat.values()), flat[ranked[0]], flat[ranked[1]] if len(ranked) > 1 else None, flat["positions"],
            storage.starts, storage.lengths, self._on_device(drops), self.seen, size.sink_tokens, size.recent_tokens,
            self.pads_device if self.pads.any() else None, self.window or 0, PROTECTED,
        )  # fmt: skip

    def _refit(self, before: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Refit what the prompt kept (``matching.refit``) against every prompt entry it held (``before``)."""
        step, self.prompt_queries = self.prompt_queries, None
        if self.window is not None or self.softcap is not None or self.pads.any():
            return
        self.biased |= matching.refit(self, step, *before)

    def allocate(self, counts: torch.Tensor, bases: torch.Tensor) -> None:
        """Give each row and head its share of the tokens (host ``counts`` ``[batch, heads]`` kept where an even
        share keeps ``bases`` ``[batch]``), from now on; the eviction that follows applies it."""
        self._forget_plans()
        self.shares = (np.asarray(counts, dtype=np.int64).copy(), np.asarray(bases, dtype=np.int64).copy())
        if self.static_capacity:
            self._device_targets = self._on_device(self.targets())

    def _on_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array as a tensor on the storage's device (the same memory on a CPU)."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        device = self.storage.device
        return tensor if torch.device(device).type == "cpu" else tensor.to(device)

    # -- rows, crop, reset ------------------------------------------------------------------------------------------

    def _read_missed(self) -> bool:
        """Whether a read this pass expected (``attention.expect``) was never taken: refused, naming the cause."""
        if self.module is not None and attention.pending(id(self.module())):
            raise ValueError(
                "the attention module did not call decodekit's sdpa wrapper for a step whose entries it reads itself: "
                "run the model with attn_implementation='sdpa'"
            )
        return False

    def _forget_plans(self) -> None:
        """Forget the quiet steps and the prepared slots (after anything that changes lengths or moves entries)."""
        self._quiet_steps = 0
        self._prepared = None
        self._fused = None

    def _select_rows(self, rows: torch.Tensor) -> None:
        if self.storage is None:
            return
        self._settle()
        self._forget_plans()
        self.scorer.flush(self)
        rows_host = rows.to("cpu", torch.long).numpy()
        self.storage.select_rows(rows)
        self.coding.select_rows(rows)
        self._set_pads(self.pads[rows_host])
        self.held_pads = self.held_pads[rows_host]
        if self.shares is not None:
            self.shares = (self.shares[0][rows_host], self.shares[1][rows_host])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder rows for beam search (beams move within their request, so the padding stays the same)."""
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.storage is not None:
            self._select_rows(torch.arange(self.rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.storage is not None:
            self._select_rows(torch.arange(self.rows)[indices.to("cpu")])

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens seen (candidate tokens rejected by assisted generation).

        The newest tokens are held (they are in the recent window), so this undoes their pass, except that the
        attention they paid to older tokens stays in those tokens' scores, and what their pass evicted stays evicted.
        """
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop takes a negative number of tokens to remove (as DynamicLayer does); got {tokens_to_remove}"
            )
        if tokens_to_remove == 0 or self.storage is None:
            return
        self._settle()
        self.scorer.flush(self)
        self._forget_plans()
        self.seen = max(self.seen + tokens_to_remove, 0)
        storage = self.storage
        longest = self.longest
        held = storage.valid(longest) & (storage.read("positions", longest) < self.seen)
        counts = held.sum(dim=-1).cpu().numpy()
        order = (~held).to(torch.uint8).argsort(dim=-1, stable=True)[..., : max(int(counts.max()), 1)]
        storage.keep(order, counts)

    def reset(self) -> None:
        self._forget_plans()
        self.storage = self.seen_device = None
        self._seen = np.zeros((), dtype=np.int64)
        self._seen_stale = False
        self.pads = self.pads_device = self.held_pads = self.shares = self.prompt_queries = self._pass = None
        self._padding_held = False
        self.biased = self.transient = False
        self.waits_for_prompt_scores, self.reads_context = self.scorer.replays, True  # (a new prompt comes)
        self.scorer.reset()
        self.coding.reset()

    # -- size -------------------------------------------------------------------------------------------------------

    # -- state ------------------------------------------------------------------------------------------------------

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Everything this layer holds, as tensors and numbers, for a saved cache (``persist.py``): the storage, the
        residual window, each row's padding, the shares, the tokens seen and the attention module's shape. Waiting
        steps are scored first; ValueError before the prompt's scores are in (there is nothing to keep yet)."""
        if self.storage is None or self.waits_for_prompt_scores or self.transient or self._pass is not None:
            raise ValueError("a CompressedCache can be saved once its prompt has been seen and scored")
        self._settle()
        self.scorer.flush(self)
        tensors, storage_numbers = self.storage.state()
        tensors = {f"storage.{name}": tensor for name, tensor in tensors.items()}
        tensors.update({f"coding.{name}": tensor for name, tensor in self.coding.state().items()})
        tensors["pads"], tensors["held_pads"] = torch.from_numpy(self.pads.copy()), torch.from_numpy(self.held_pads)
        if self.shares is not None:
            tensors["share_counts"], tensors["share_bases"] = (torch.from_numpy(part) for part in self.shares)
        numbers = {
            "storage": storage_numbers, "seen": self.seen, "window": self.window, "softcap": self.softcap,
            "dtype": str(self.dtype).removeprefix("torch."), "biased": self.biased, "padding_held": self.padding_held,
            "head_dim": self.head_dim, "reads_context": self.reads_context,
        }  # fmt: skip
        return tensors, numbers

    def restore(self, tensors: dict[str, torch.Tensor], numbers: dict, device: torch.device | str) -> None:
        """Hold what ``state`` gave (on ``device``), as the layer that saved it did after its last pass."""
        self.reset()
        self.dtype = getattr(torch, numbers["dtype"])
        coding_state = {name.removeprefix("coding."): t for name, t in tensors.items() if name.startswith("coding.")}
        self.coding.restore(self.dtype, coding_state, device)
        self.head_dim = numbers["head_dim"]
        fields = self._fields(self.head_dim)
        storage_state = {name.removeprefix("storage."): t for name, t in tensors.items() if name.startswith("storage.")}
        self.storage = EntryStorage.from_state(fields, storage_state, numbers["storage"], device)
        self._set_pads(tensors["pads"].numpy().astype(np.int64).copy())
        self.held_pads = tensors["held_pads"].numpy().astype(np.int64).copy()
        self._padding_held = bool(numbers["padding_held"])
        self.window, self.softcap, self.biased = numbers["window"], numbers["softcap"], bool(numbers["biased"])
        self.waits_for_prompt_scores = False
        # Whether passes of several tokens still read the context, as in the cache saved (a file without it: as in a
        # cache that decoded nothing, the one written before passes could be context)
        self.reads_context = bool(numbers.get("reads_context", True))
        if self.static_capacity:
            self.seen_device = torch.from_numpy(self._seen)
            if torch.device(device).type != "cpu":
                self.seen_device = self.seen_device.to(device)
        self.seen = int(numbers["seen"])
        if "share_counts" in tensors:
            self.allocate(tensors["share_counts"].numpy(), tensors["share_bases"].numpy())

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds on the device: the storage, the residual window, the waiting steps' queries,
        the prompt's queries kept for a refit, and the Hadamard matrix that rotates coded keys."""
        if self.storage is None:
            return []
        held = [*self.storage.held_tensors(), *self.coding.held_tensors(), *self.scorer.held_tensors(),
                self.pads_device]  # fmt: skip
        if self.seen_device is not None:
            held.append(self.seen_device)
        if self.prompt_queries is not None:
            held.extend(part for part in (self.prompt_queries.columns, self.prompt_queries.cos,
                                          self.prompt_queries.sin) if part is not None)  # fmt: skip
        if self.coding.quantized and self.coding.quantizers["keys"] is not None:
            head_dim = self.coding.residual_keys.shape[-1]
            held.append(hadamard(rotation_block(head_dim), self.storage.device))
        return held

    def memory_bytes(self) -> int:
        """Bytes of every storage behind :meth:`held_tensors`, each counted once."""
        return sum(storage_bytes(self.held_tensors()).values())
