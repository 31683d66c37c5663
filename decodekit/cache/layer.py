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
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.nn import functional
from transformers.cache_utils import DynamicLayer

from decodekit.cache.count import LiveCount, SeenCount
from decodekit.cache.eviction import Eviction
from decodekit.cache.joint import SharedRoom
from decodekit.cache.matching import EntryMatching
from decodekit.cache.policy import Allocated, EvictionPolicy
from decodekit.cache.quantize import Quantizer, hadamard, rotation_block
from decodekit.cache.scoring import EntryScoring
from decodekit.cache.storage import (
    BIAS_DTYPE,
    BOOKKEEPING,
    CODING,
    EXACT,
    EntryStorage,
    positions_from,
    scatter_position,
    storage_bytes,
)
from decodekit.cache.waiting import WaitingSteps
from decodekit.settings import CODED_BITS


class StoredPass(NamedTuple):
    """What ``CompressedLayer.store`` leaves for the rest of the pass (``write_pass_exact``, ``finish_pass``)."""

    deferred: bool  # whether the pass's scoring waits for the next eviction
    free: torch.Tensor | None  # the free slots its token went into, or None when it was appended
    columns: torch.Tensor  # the observed queries' projection columns, their scaling and rotation
    scaling: float
    cos: torch.Tensor
    sin: torch.Tensor
    read_keys: torch.Tensor  # the pass's own keys, as attention reads them, and its values
    value_states: torch.Tensor


class CompressedLayer(SeenCount, LiveCount, EntryStorage, EntryScoring, Eviction, EntryMatching, DynamicLayer):
    """A ``DynamicLayer`` that scores its entries by the attention they receive and evicts the least useful.

    Its jobs are split by file: ``storage.py`` (how entries are held), ``scoring.py`` (what they are
    worth), ``eviction.py`` (which go), ``matching.py`` (what the prompt's kept entries become), ``count.py``
    (the tokens seen and the live entries counted); this file is the layer transformers talks to (``update``,
    masks, beams, crop) and the state those share.
    """

    is_croppable = True

    @property
    def is_compileable(self) -> bool:
        """Whether ``model.generate`` may compile this layer's decoding steps (with ``compile_config=``, and on CUDA by
        default, as it does for a StaticCache: CUDA graphs, ``mode="reduce-overhead"``): with one eviction per step
        under a budget in tokens, past the first step a step runs one graph that takes no number that changes from
        step to step (``_add_seen``, ``_reserve_slot_for_steps``). At longer intervals the steps between evictions
        take such numbers, for each of which CUDA graphs would record anew: generate then decodes eagerly."""
        return self.policy.steps_keep_one_room

    def __init__(
        self, policy: EvictionPolicy, shared: SharedRoom | None = None, shared_index: int = 0, *, matched: bool = False
    ) -> None:
        super().__init__()
        # The room this layer shares with the cache's other layers, and its index there (see ``joint.py``).
        self.shared, self.shared_index = shared, shared_index
        # Whether decoding steps were appended to the reserved room since the bookkeeping views last covered
        # every entry (``_append_to_prepared_room``, ``_catch_up``).
        self._lagging = False
        self.policy = policy
        # The tokens seen (``count.py``); compiled steps count them on the device under a budget in tokens (a size in
        # bytes counts none of its own).
        self._start_count(on_device=policy.budget is not None)
        self._marks_static = False  # whether the tensors it keeps are on CUDA (``storage.mark_static``)
        self.pads: torch.Tensor | None = None  # [batch]: each row's left padding (its first pads positions)
        # Per entry, [batch, kv_heads, slots]: score, value norm, logical position, live, log-mass bias.
        self._scores: torch.Tensor | None = None
        self._value_norms: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._live: torch.Tensor | None = None
        self._biases: torch.Tensor | None = None
        # Attention matching (``matching.py``): whether the prompt's kept entries are refit when it is evicted, the
        # prompt pass's queries kept for that until then, and whether the refit gave the entries biases (which every
        # later pass then adds to their logits: ``biased_mask``, and the scoring).
        self.matched = matched
        self._match_queries: tuple[torch.Tensor, float, torch.Tensor, torch.Tensor] | None = None
        self.biased = False
        # Quantized storage (``policy.kv_bits``, ``policy.key_bits``): ``keys`` or ``values`` or both hold codes,
        # with each entry's group scales and offsets beside them (``CODING``; keys coded turned by a Hadamard
        # rotation, see ``Quantizer``); per row, the last ``policy.exact_recent`` tokens' exact keys and values in a
        # ring [batch, kv_heads, ring, head_dim] (in 16 bits; ring = exact_recent, 0 for none), slot
        # ``position % ring``, with the position each ring slot holds (``recent_positions``, -1 for none).
        widths = {"keys": policy.key_bits or policy.kv_bits, "values": policy.kv_bits}
        self.quantizers = {part: Quantizer(bits, policy.kv_group_size, rotated=part == "keys") if bits in CODED_BITS
                           else None for part, bits in widths.items()}  # fmt: skip
        self.quantized = any(quantizer is not None for quantizer in self.quantizers.values())
        # Whether attention reads this layer's coded keys turned, as coded (set by the cache where the attention
        # module's queries can be turned alike: ``rotary.turned_query_columns``), instead of turned back.
        self.reads_turned_keys = False
        self.storage_dtype: torch.dtype | None = None  # what keys, values (or their scales) are stored in
        coding = tuple(name for name in CODING if self.quantizers[name.split("_")[0] + "s"] is not None)
        # Value norms are kept only where eviction ranks by them (not under allocation "global" or "heads"), biases
        # only where the prompt's kept entries are refit.
        kept_apart = {"_value_norms": policy.ranks_by_value_norm, "_biases": matched}
        self.bookkeeping = tuple(name for name in BOOKKEEPING if kept_apart.get(name, True))
        self.entries = ("keys", "values", *self.bookkeeping, *coding)
        self.key_scales = self.key_offsets = self.value_scales = self.value_offsets = None
        self.recent_keys = self.recent_values = None
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
        # Whether the prompt's pass left fewer entries than the budget in a room made for all of it, which decoding
        # steps fill (``_reserve_slot_for_steps``); compiled steps then count the live entries on the device.
        self._growing_room = False
        # Decoding steps that cannot make any row go over its target (targets never shrink as tokens come),
        # so that ``compress`` skips them; 0 after anything that changes the counts.
        self._quiet_steps = 0
        # Decoding steps that may still append to the prepared room with their scoring waiting, as the last such
        # step found (``_plain_steps_left``), while ``keys`` is still the view that step made (anything that moves
        # entries makes another); 0 after anything that changes the counts or the room.
        self._plain_steps = 0
        self._plain_view: torch.Tensor | None = None
        # The attention module's own shape: a sliding window (a query sees the last ``sliding_window``
        # positions only) and a logit soft cap, both None for plain causal attention.
        self.sliding_window: int | None = None
        self.softcap: float | None = None
        # Reconstruction scoring: eviction waits until the prompt has been replayed (deferred), and
        # while it is replayed (replaying) an entry's score is the most attention a replay query pays it.
        self.deferred = policy.scoring == "reconstruction"
        self.replaying = False
        self.replay_span: tuple[int, int, int] | None = None  # (start, stop, prompt length) under replay_scope="chunk"
        # Under replay_output_norms, the coming replay pass's 1 / hidden-state norm per observed query
        # [batch, tokens] and each query head's output-projection Gram matrix [heads, head_dim, head_dim].
        self.replay_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        self._free: torch.Tensor | None = None  # [batch, kv_heads]: where this pass's one token goes
        self._stored_pass: StoredPass | None = None  # between ``store`` and ``finish_pass``
        # Slots the last in-place eviction freed, [batch, kv_heads, n], and how many of them the next
        # tokens have taken; None when unknown (a dead slot is then searched for).
        self._freed: torch.Tensor | None = None
        self._freed_taken = 0
        # While decoding with eviction_interval > 1: per-entry tensors with room for the next tokens,
        # of which the attributes above are views of the first ``slots`` entries (see ``_append``).
        self._spare: dict[str, torch.Tensor] | None = None
        self._room_shared = False  # whether that room is this layer's slice of the room shared by the layers
        # Views of that room eager steps and evictions place, by entry kind, first slot and length (the same at every
        # interval, made once per room: ``_room_view``).
        self._room_views: dict[tuple[str, int, int], torch.Tensor] = {}
        # The keys and values the layer placed itself, weakly (``_place``): anything else was put there from outside.
        self._placed: dict[str, weakref.ref | None] = {}
        # Decoding steps in the spare room whose attention is not yet in the scores: their queries with
        # their rotation (cos, sin), and the slot of the first one's token (see ``_score_pending``).
        self._pending = WaitingSteps()
        # The coming pass's observed tokens: the query columns of their projection, the function that makes
        # queries of them (``observer.queries_from_projection``), the scaling and their rotation (cos, sin).
        self._queries: tuple[torch.Tensor, Callable, float, torch.Tensor, torch.Tensor] | None = None
        self._to_queries: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def scores(self) -> torch.Tensor | None:
        """Per entry, the decayed attention it has received (decoding steps not yet scored are added first)."""
        self._score_pending()
        return self._scores

    @scores.setter
    def scores(self, value: torch.Tensor | None) -> None:
        self._score_pending()
        self._replace_bookkeeping("_scores", value)

    @property
    def value_norms(self) -> torch.Tensor | None:
        """Per entry, the norm of its value vector (decoding steps not yet scored have theirs added first)."""
        self._score_pending()
        return self._value_norms

    @value_norms.setter
    def value_norms(self, value: torch.Tensor | None) -> None:
        self._replace_bookkeeping("_value_norms", value)

    @property
    def positions(self) -> torch.Tensor | None:
        """Per entry, its logical position (int32)."""
        self._catch_up()
        return self._positions

    @positions.setter
    def positions(self, value: torch.Tensor | None) -> None:
        self._replace_bookkeeping("_positions", value)

    @property
    def live(self) -> torch.Tensor | None:
        """Per entry, whether it is a token attention may see (not padding, not evicted in place, not cropped)."""
        self._catch_up()
        return self._live

    @live.setter
    def live(self, value: torch.Tensor | None) -> None:
        self._replace_bookkeeping("_live", value)

    @property
    def biases(self) -> torch.Tensor | None:
        """Per entry, the log-mass bias added to its logit (0 but for the prompt's refit entries), float16."""
        self._catch_up()
        return self._biases

    @biases.setter
    def biases(self, value: torch.Tensor | None) -> None:
        self._replace_bookkeeping("_biases", value)

    @property
    def rows(self) -> int:
        """Rows of the batch (beams included), which share a ``max_bytes`` size."""
        return self.pads.shape[0] if self.pads is not None else 1

    @property
    def kept(self) -> int:
        """The most tokens any row keeps (other rows may keep fewer)."""
        return self.live_range[1]

    def get_seq_length(self) -> int | torch.Tensor:
        """The logical length (all tokens seen), from which models derive positions: inside a compiled step that
        counts on the device, the 0-d tensor it counts in (as transformers' StaticLayer returns its own)."""
        return self._seen_now()

    @property
    def awaits_replay_alone(self) -> bool:
        """Whether the coming replay's scores will be this layer's only ones (reconstruction scoring with the
        budget shared by layers or heads): until then, a pass's attention is not worth scoring. A uniform
        allocation ranks by both (``CompressedCache.replay``)."""
        return self.deferred and not self.replaying and self.policy.allocation != "uniform"

    def _fills_free_slot(self, query_length: int) -> bool:
        """Whether a pass of ``query_length`` tokens goes into a dead slot of every row instead of a new column. After
        compiled steps filling the room made for the budget, a step's token does (a row keeps a dead slot there
        between steps), known without counting the live entries again (a read of the device)."""
        if query_length == 1 and self._live_counts_stale and self._growing_room:
            return True
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
        mask: bool = True,
    ) -> torch.Tensor | None:
        """Prepare a forward pass of ``query_length`` tokens; return its attention mask (see ``pass_mask``), or None
        without ``mask`` (a caller that makes the mask itself, as ``HeadsLayer`` does for its heads at once).

        ``pads``, ``sliding_window`` and ``softcap`` are read on the first pass only: each row's left
        padding, and the attention module's shape (a local-attention layer, capped logits).
        """
        if not self.is_initialized:
            self.sliding_window, self.softcap = sliding_window, softcap
            if pads is None:
                raise ValueError("the first pass of a CompressedCache layer needs each row's left padding (pads)")
            self.pads = pads.to(dtype=torch.long)
            self._set_live_counts({(pads, None): 0 for pads in self.pads.unique().tolist()})
        if query_length == 1 and self._plain_steps and self.keys is self._plain_view:
            self._free = None  # a plain decoding step: no free slot, no mask (see ``_may_defer_scoring``)
            return None
        if query_length == 1 and self._room_to_open():
            self._open_room()
        if query_length == 1 and self._grows_in_graph():
            # A compiled step filling the room made for the budget: the first dead slot of each row and head (an
            # unfilled one, or the one the last eviction freed), and a mask made from ``live`` whatever the counts.
            self._free = (~self.live).to(torch.uint8).argmax(dim=-1)
            return self.pass_mask(query_length, plain=True) if mask else None
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
        return self.pass_mask(query_length) if mask else None

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

    def weigh_replay(self, inverse_hidden_norms: torch.Tensor, output_grams: torch.Tensor) -> None:
        """Weights for the coming replay pass's scores (``replay_output_norms``): ``[batch, tokens]``, one over each
        observed query's hidden-state norm, and ``[heads, head_dim, head_dim]``, each query head's output
        projection ``W`` as ``W^T W`` (so that an entry's output norm is ``sqrt(v^T W^T W v)``)."""
        self.replay_weights = (inverse_hidden_norms, output_grams)

    def pass_mask(self, query_length: int, *, plain: bool = False) -> torch.Tensor | None:
        """``[batch, kv_heads, query_length, slots]``, True where a query of the coming pass may attend.

        None when the model's own mask is right: on the first pass, and later when no row has a dead
        slot, none was padded and the layer has no sliding window (the stored layout is then the
        plain causal one), unless ``plain`` asks for the mask of that layout too (under
        ``allocation="global"`` layers differ in length, and the model's mask fits the first's).
        Queries after the first pass are real tokens; they see every live entry and the new tokens
        up to themselves.
        """
        if not self.is_initialized or not (plain or self.needs_mask(query_length)):
            return None
        free, seen = self._free, self._seen_now()
        device = self.live.device
        query_positions = positions_from(seen, query_length, device)[:, None]
        if free is not None:
            slot = free[..., None]
            live, positions = self.live.scatter(2, slot, True), scatter_position(self.positions, slot, seen)
            return live[:, :, None, :] & self._in_window(positions[:, :, None, :], query_positions)
        batch, kv_heads, slots = self.live.shape
        older = self.live[:, :, None, :] & self._in_window(self.positions[:, :, None, :], query_positions)
        new_positions = query_positions.view(1, -1)
        causal = (new_positions <= query_positions) & self._in_window(new_positions, query_positions)
        older = older.expand(batch, kv_heads, query_length, slots)
        return torch.cat([older, causal.expand(batch, kv_heads, -1, -1)], dim=-1)

    def needs_mask(self, query_length: int) -> bool:
        """Whether the coming pass needs a mask of its own (``pass_mask``): some row has a dead slot, was padded, or
        the layer has a sliding window."""
        least_live = self.live_range[0] + query_length
        stored = self.slots + (0 if self._free is not None else query_length)
        return self.pad_range[1] != 0 or least_live < stored or self.sliding_window is not None

    def biased_mask(self, query_length: int, visible: torch.Tensor | None) -> torch.Tensor:
        """The coming pass's mask as logit offsets, float32 ``[batch, kv_heads, query_length, columns]``: each
        entry's bias (``biases``) where ``visible`` (the pass's mask, or None for ``pass_mask(plain=True)``), -inf
        where not; for a layer whose prompt entries were refit (``biased``)."""
        if visible is None:
            visible = self.pass_mask(query_length, plain=True)
        return torch.where(visible, self.bias_row(visible.shape[-1]), -math.inf)

    def bias_row(self, columns: int) -> torch.Tensor:
        """``[batch, kv_heads, 1, columns]`` float32: the stored entries' biases, 0 for the pass's own tokens (in
        their free slot, or after the stored entries) and for the columns past them."""
        biases = self.biases.float()
        if self._free is not None:
            biases = biases.scatter(2, self._free[..., None], 0.0)
        return functional.pad(biases, (0, columns - biases.shape[-1]))[:, :, None, :]

    def _in_window(self, positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor | bool:
        """Whether entries at ``positions`` are inside the sliding window of queries at ``query_positions``."""
        if self.sliding_window is None:
            return True
        return query_positions - positions < self.sliding_window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store a pass's keys and values and score what it can; return what attention reads."""
        if self.store(key_states, value_states):
            return self.keys, self.values
        keys, values = self.dense()
        self.write_pass_exact(keys, values)
        self.finish_pass(keys, values)
        return keys, values

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor, *, coded=None, read_keys=None) -> bool:
        """The first half of ``update``: store the pass's entries (``coded``: already coded as this layer stores
        them, ``_code``, and ``read_keys``: the keys as attention reads them, ``_as_read``, when the caller made
        those for several heads at once). True when the pass is done and attention
        reads the stored tensors as they are (a decoding step between evictions); otherwise attention reads
        ``dense()`` with ``write_pass_exact``, and ``finish_pass`` scores it (a caller may make that copy itself, as
        ``HeadsLayer`` does for all its heads at once)."""
        if self._queries is None:
            raise ValueError(
                "this CompressedCache received keys without the queries of their forward pass: it works only "
                "inside a forward pass of the model it was built with, whose attention modules it observes. Pass it "
                "as past_key_values to that model's forward or generate, not to another model and not to "
                "cache.update() directly; after unbind(model), build a new CompressedCache(model, ...)"
            )
        (columns, self._to_queries, scaling, cos, sin), free = self._queries, self._free
        self._queries = self._free = None
        if self._room_shared and torch.compiler.is_compiling():
            # Steps decoded eagerly gave the layers slices of one room (``joint.py``), which a compiled graph takes as
            # aliased inputs that it cannot regenerate: the first compiled step gives this layer a room of its own.
            self._apply_to_rows(torch.clone)
        batch, kv_heads, new, _ = key_states.shape
        plain = new == 1 and free is None and self._plain_steps and self.keys is self._plain_view
        if plain or (
            new == 1 and free is None and self._has_room_for_step(key_states.dtype) and self._may_defer_scoring()
        ):
            # A decoding step between evictions: store the key and value; its scoring waits.
            self._append_to_prepared_room({"keys": key_states, "values": value_states})
            self._add_live(new)
            self._add_seen(new)
            self._wait_for_scoring(columns, scaling, cos, sin)
            self._plain_steps = self._plain_steps - 1 if plain else self._plain_steps_left()
            self._plain_view = self.keys
            return True
        first_pass = not self.is_initialized
        if first_pass:
            self._marks_static = key_states.is_cuda
            self.lazy_initialization(key_states, value_states)
            self._make_device_count(key_states)
            self.storage_dtype = self.dtype
            if self.policy.kv_bits is not None and self.dtype.itemsize > 2:
                self.storage_dtype = torch.float16  # 16 bits (scales at 4 and 8) in a 32-bit model
            if self.quantized:
                self._start_coding(key_states)
            empty = key_states.new_zeros((batch, kv_heads, 0), dtype=torch.float32)
            self.scores = empty
            if "_value_norms" in self.bookkeeping:
                self.value_norms = empty.clone()
            self.positions = empty.to(torch.int32)
            self.live = empty.to(torch.bool)
            if "_biases" in self.bookkeeping:
                self.biases = empty.to(BIAS_DTYPE)
        if coded is None or first_pass:
            coded, read_keys = self._code(key_states, value_states)
        elif read_keys is None:
            read_keys = self._as_read(key_states)
        if first_pass:
            for name, entry in coded.items():
                self._place(name, entry[:, :, :0])
        deferred = self._defers_scoring(new, free)
        if deferred and self._spare_room() >= 1:
            self._append_to_prepared_room(coded)
        else:
            self._store(coded, value_states, free, first_pass)
        if first_pass:
            self._set_live_counts({group: max(new - group[0], 0) for group in self.live_by_group})
        elif new == 1 and self._grows_in_graph():
            self._live_counts_stale = True  # ``live`` counts them: the host counts again when it next reads them
        else:
            self._add_live(new)
        self._add_seen(new)
        # The first decoding step after a pass of several tokens reserves the room (``_append``); its scoring can
        # then wait like the next steps', for the next eviction.
        deferred = deferred or (new == 1 and free is None and self._may_defer_scoring())
        if not self.replaying and not deferred:
            self.scores.mul_(self.policy.score_decay)  # the new entries hold 0 so far, which decays to 0
        if self.quantized and not self.replaying:  # a replay's tokens are forgotten after it
            self._remember_recent(read_keys, value_states)
        self._stored_pass = StoredPass(deferred, free, columns, scaling, cos, sin, read_keys, value_states)
        return False

    def _plain_steps_left(self) -> int:
        """How many of the next decoding steps may append to the prepared room with their scoring waiting, as this
        one did, without checking again (``_may_defer_scoring``): the room left, and the steps that may still wait
        before the next eviction."""
        waiting = self.policy.eviction_interval - len(self._pending)
        return max(min(self._spare["keys"].shape[2] - self.slots, waiting), 0)

    def finish_pass(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The second half of ``update``: score the stored pass on ``keys`` and ``values`` as attention reads them
        (or queue its queries for the next eviction)."""
        stored, self._stored_pass = self._stored_pass, None
        if self.matched and self.deferred and not self.replaying and self._match_queries is None:
            self._match_queries = (stored.columns, stored.scaling, stored.cos, stored.sin)  # refit at its eviction
        if stored.deferred:  # the step went into reserved room (kept or made anew by ``_append``)
            self._wait_for_scoring(stored.columns, stored.scaling, stored.cos, stored.sin)
            return
        if self.awaits_replay_alone:
            if self.policy.estimates_replay(self.seen, self.rows):  # the replay's scores, estimated now
                self.scores = self._replay_estimate(stored, keys)
            return  # the replay's scores replace anything this pass's queries would give
        queries = self._rotated_queries(stored.columns, stored.cos, stored.sin)
        received = self._attention_received(queries, stored.scaling, keys, values)
        if self.replaying:
            self.scores = torch.maximum(self.scores, received)
        else:
            self.scores.add_(received)

    def _per_row(self) -> tuple[str, ...]:
        return (*self.entries, "pads", "allocated", *EXACT)

    def _apply_to_rows(self, operation) -> None:
        """Apply a row operation (select, reorder, repeat) to every per-row tensor; with reserved room, to
        the whole room, so that beam search keeps it (its prepared entries are the same in every row)."""
        self._score_pending()
        self._forget_freed()
        self._quiet_steps = 0  # a new batch of rows may share max_bytes differently
        names = self._per_row()
        self._room_shared = False  # the operation makes tensors of this layer's own
        if self._has_spare():
            slots = self.slots
            room = {name: operation(self._spare[name]) for name in self.entries}
            for name in self.entries:
                self._place(name, room[name].narrow(2, 0, slots))
            self._hold_room(room, shared=False)
            names = names[len(self.entries) :]
        for name in names:
            tensor = getattr(self, name)
            if tensor is not None:
                self._place(name, operation(tensor))

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
        self._give_up_room()  # it was prepared for the positions after the forgotten tokens
        self._recount()

    def reset(self) -> None:
        super().reset()
        self._live_counts_stale = self._growing_room = False  # (nothing left to count again)
        self._seen_device = None
        self._pending = WaitingSteps()
        self._scores = self.value_norms = self.positions = self.live = self.pads = self.allocated = None
        self._biases, self._match_queries, self.biased = None, None, False
        for name in (*CODING, *EXACT, "recent_positions"):
            setattr(self, name, None)
        self._queries = self._free = None
        self._give_up_room()
        self._room_shared = False
        self._placed = {}
        self._lagging = False
        self._freed, self._freed_taken = None, 0
        self.sliding_window = self.softcap = None
        self.deferred, self.replaying = self.policy.scoring == "reconstruction", False
        self._set_live_counts({})
        self.seen = 0

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer holds: keys, values and per-entry bookkeeping (with the reserved room and
        dead slots behind them), the rows' padding, freed-slot lists, the count of tokens seen that compiled
        steps keep, the waiting decoding steps' queries with their rotation, and the Hadamard matrix that turns
        coded keys (shared by every layer)."""
        others = ("recent_positions", "_freed", "_free", "_seen_device")
        held = [getattr(self, name) for name in (*self._per_row(), *others)]
        if self.is_initialized and self.quantizers["keys"] is not None:
            held.append(hadamard(rotation_block(self.recent_keys.shape[-1]), self.recent_keys.device))
        if self._spare is not None:
            held.extend(self._spare.values())
        held.extend(self._pending.held_tensors())
        if self._queries is not None:
            held.extend(part for part in self._queries if isinstance(part, torch.Tensor))
        return [tensor for tensor in held if isinstance(tensor, torch.Tensor)]

    def memory_bytes(self) -> int:
        """Bytes of every storage behind :meth:`held_tensors`, each counted once (a view holds its whole storage)."""
        return sum(storage_bytes(self.held_tensors()).values())
