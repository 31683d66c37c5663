"""When and what a compressed cache layer evicts: each row down to its target (a budget, a ratio, a size in
bytes, or its share under ``allocation="global"``), in place or into reserved room, with the host-side
counts that let it decide without reading the device.

``Eviction`` is a mixin of ``CompressedLayer``; the attributes it works on are set up in
``CompressedLayer.__init__``.
"""

from __future__ import annotations

import math

import torch

from decodekit.cache.policy import Allocated
from decodekit.cache.scoring import best_in_slot_order
from decodekit.cache.storage import mark_static, write_slots


class Eviction:
    """Keeping each row of a ``CompressedLayer`` within its target."""

    def compress(self, new: int) -> None:
        """Evict each row down to its target, after a pass of ``new`` tokens; reuse slots where possible.

        A row over its target (real tokens seen) keeps its sinks and recent tokens, then the best
        ranked, up to the target, or after one decoding step up to the target less
        ``eviction_interval - 1`` (``EvictionPolicy.kept``): the next steps then fill the freed slots
        and evict nothing. When the spare slots per row are no more than that, evicted entries are
        only marked dead (the next tokens take the slots); otherwise the storage shrinks to the row
        that keeps the most.
        """
        self._compress(new)
        if self.shared is not None and self.shared_index == len(self.shared.layers) - 1:
            self.shared.evict_due()  # the pass's last layer: the layers that wait evict now (``joint.py``)

    def _compress(self, new: int) -> None:
        if self.deferred:
            return
        if new == 1 and self._grows_in_graph():
            self._evict_in_graph()
            return
        if new == 1 and self._quiet_steps > 0:
            self._quiet_steps -= 1
            return
        if self._match_queries is not None:  # the prompt's eviction, whose kept entries are refit (``matching.py``)
            self._evict_and_match(new)
        else:
            self._evict(new)
        if new > 1:
            self._reserve_slot_for_steps()
            self._reserve_room_for_steps()
        self._quiet_steps = self._steps_without_eviction()

    def _holds_step_room(self) -> bool:
        """Whether the storage is the one a step evicting one token under a budget in tokens keeps (unpadded, at most
        ``budget + 1`` slots): entries that go then go in place, dead slots included (a crop's), and the next steps
        fill them, so that the tensors stay the same ones (see ``_reserve_slot_for_steps``)."""
        return self.policy.steps_keep_one_room and self.pad_range[1] == 0 and self.slots <= self._fixed_target() + 1

    def _reserve_slot_for_steps(self) -> None:
        """With one eviction per step under a budget in tokens, after a pass of several tokens that left at most the
        budget's slots, none of them dead in an unpadded batch (exact or coded; a left-padded batch's steps are
        masked, so its rows may hold dead slots besides their padding): make the room the budget and each step's
        token take, ``budget + 1`` slots, the new ones dead, so that every step writes into the same tensors, from
        the first on. A compiled step then returns no tensor the cache keeps (CUDA graphs overwrite what a graph
        returned when they replay it) and takes no number that changes (they record a graph anew for each new one),
        as transformers' StaticCache keeps ``max_cache_len`` slots. A full row's one dead slot is its freed slot,
        which each step's token takes and its eviction frees again. A row under the budget gets the room as reserved
        room after its entries (``_growing_room``): eager steps append into it, attending to the entries stored so
        far, and the first compiled step opens all of it (``_open_room``), its unfilled slots dead, whose live
        entries compiled steps then count on the device (``_evict_in_graph``), as they count those of a left-padded
        batch's shorter rows, which fill their padding slots first."""
        if self._has_spare() or not self.policy.steps_keep_one_room or self.allocated is not None:
            return
        target, stored = self._fixed_target(), self.slots
        if stored > target or (self.pad_range[1] == 0 and self.live_range[0] != stored):
            return  # (an unpadded row holds a dead slot, which its steps would attend to without a mask)
        room = target + 1 - stored
        spare = {}
        for name in self.entries:  # the new slots: zeros, so dead (live False), score 0, position 0
            held = getattr(self, name)
            spare[name] = torch.cat([held, held.new_zeros((*held.shape[:2], room, *held.shape[3:]))], dim=2)
            self._place(name, spare[name] if room == 1 else spare[name].narrow(2, 0, stored))
        if room > 1:
            self._hold_room(spare, shared=False)
            self._prepare_room(stored, self._seen_now())
        # The list of freed slots: the one dead slot of a full row, to take first; used up otherwise (the steps take
        # the first dead slot), kept so that a compiled eviction writes into it. Rows of several paddings evict apart,
        # keeping no list, so their later steps search for the dead slot: where every row is full, that is the slot
        # the list would give, and the first step searches too, running the graph of the steps after it.
        self._freed = self._live.new_full((*self._live.shape[:2], 1), target, dtype=torch.long)
        searched = len(self.live_by_group) > 1 and self.live_range[0] == target
        self._freed_taken = 0 if room == 1 and not searched else 1
        # A row under the budget fills up (every row of a prompt shorter than it; a left-padded batch's shorter rows
        # even where the longest fills it): its live entries are counted on the device in compiled steps.
        self._growing_room = self.live_range[0] < target
        mark_static(self._freed)

    def _room_to_open(self) -> bool:
        """Whether this compiled step is the first of a room filling up, which ``_open_room`` opens."""
        return (
            self._growing_room
            and torch.compiler.is_compiling()
            and self._has_spare()
            and self.slots < self._spare["keys"].shape[2]
        )

    def _open_room(self) -> None:
        """In the first compiled step of a room filling up (``_growing_room``): make every layer tensor the whole
        reserved room, ``budget + 1`` slots, the slots no step filled yet dead, so that the steps' shapes no longer
        change as the room fills (``_grows_in_graph``)."""
        filled, spare = self.slots, self._spare
        for name in self.entries:
            self._place(name, spare[name])
        self._live.narrow(2, filled, self._live.shape[2] - filled).fill_(False)

    def _grows_in_graph(self) -> bool:
        """Whether this is a compiled step filling the room ``_reserve_slot_for_steps`` made for a prompt shorter than
        the budget (``budget + 1`` slots, one eviction per step; a padded row fills its padding slots too): its live
        entries are counted on the device (``_evict_in_graph``), since the host's counts would change at every step
        until the budget fills, each a number the step's graph takes."""
        return (
            self._growing_room
            and torch.compiler.is_compiling()
            and self.allocated is None
            and self.slots == self._fixed_target() + 1
        )

    def _evict_in_graph(self) -> None:
        """A compiled step's eviction in a room filling up (``_grows_in_graph``): a row and head over the budget
        drops its lowest-ranked live entry, as ``_evict`` decides from the host's counts; the next step takes the
        first dead slot. Nothing here depends on a count the host keeps."""
        victims = self._lowest_ranked_live(1)
        over = self.live.sum(dim=-1, keepdim=True) > self._fixed_target()
        write_slots(self.live, victims, over.logical_not())

    def _lowest_ranked_live(self, count: int) -> torch.Tensor:
        """The slots of each row and head's ``count`` lowest-ranked live entries, ``[batch, kv_heads, count]``. One
        victim, as at every step with ``eviction_interval=1``, is a reduction, which a compiled step fuses with the
        ranking's other operators, where a top-k runs on its own."""
        ranked = torch.where(self.live, self._priority(), math.inf)
        if count == 1:
            return ranked.argmin(dim=-1, keepdim=True)
        return ranked.topk(count, dim=-1, largest=False).indices

    def _steps_without_eviction(self) -> int:
        """How many decoding steps from now can evict nothing: the least room under its target of any row
        (targets never shrink as tokens come), when the stored slots are few enough that such a step
        reshapes nothing; else 0."""
        if self.slots - self.live_range[1] > 1 + self.policy.slack(1):
            return 0
        rows, seen = self.rows, self._seen_now()
        room = [
            self.policy.target(seen - pads, rows, allocated) - live
            for (pads, allocated), live in self.live_by_group.items()
        ]
        return max(min(room), 0) if room else 0

    def _evict(self, new: int) -> None:
        """``compress``'s work when a row may be over its target."""
        slack = self.policy.slack(new)
        before = self.live_by_group
        rows, seen = self.rows, self._seen_now()
        after = {
            (pads, allocated): self.policy.kept(live, seen - pads, slack, rows, allocated)
            for (pads, allocated), live in before.items()
        }
        self._set_live_counts(after)
        uniform = len(before) == 1  # one group: every row holds the same entries
        bound = max(before[group] - after[group] for group in before)  # the most any row evicts
        keep_most = self.live_range[1]
        in_place = self.slots - keep_most <= 1 + slack or self._holds_step_room()
        if bound == 0 and in_place:
            return
        # With reserved room, the kept entries move to its front, so that the steps until the next eviction append
        # after them; evicting at every step, the few that go are marked dead in place and the next steps take their
        # slots (the room then serves only a target that grows).
        if uniform and self._has_spare() and not (in_place and self.policy.eviction_interval == 1):
            if self.shared is not None:
                self.shared.defer(self, keep_most)  # with the other layers, after the pass's last one
            else:
                self.keep_best(keep_most)
            return
        if uniform and in_place:
            # Every row drops its ``bound`` lowest-ranked entries, in place; the next tokens take their slots.
            victims = self._lowest_ranked_live(bound)
            write_slots(self.live, victims, False)
            self._remember_freed(victims)
            return
        self._forget_freed()
        live_count = self.live[:, :1].sum(dim=-1, keepdim=True)  # [batch, 1, 1]: the same for every head
        allocated = self.allocated[:, None, None] if self.allocated is not None else None
        keep = self.policy.kept_counts(live_count, (seen - self.pads)[:, None, None], slack, rows, allocated)
        priority = self._priority()
        if in_place:
            # Mark the lowest-ranked live entries dead, in place.
            lowest = torch.where(self.live, priority, math.inf).topk(bound, dim=-1, largest=False)
            rank = torch.arange(bound, device=priority.device)
            stays = self.live.gather(2, lowest.indices) & (rank < (live_count - keep)).logical_not()
            write_slots(self.live, lowest.indices, stays)
            return
        ranked = torch.where(self.live, priority, -math.inf).topk(keep_most, dim=-1).indices
        stays = torch.arange(keep_most, device=priority.device) < keep
        index, order = ranked.sort(dim=-1)
        self._keep(index)
        self.live &= stays.expand_as(order).gather(2, order)

    def _remember_freed(self, victims: torch.Tensor) -> None:
        """Keep the slots an in-place eviction freed for the next tokens: inside a compiled step, written into the
        list the last one left when it has their shape, so that a step's graph returns no new tensor for it (a CUDA
        graph's outputs are overwritten when it runs again)."""
        freed = self._freed
        if torch.compiler.is_compiling() and freed is not None and freed.shape == victims.shape:
            freed.copy_(victims)
        else:
            self._freed = victims
            if self._marks_static:
                mark_static(victims)
        self._freed_taken = 0

    def keep_best(self, keep: int) -> None:
        """Decoding with spare room: keep each row's ``keep`` best-ranked entries in the first ``keep`` slots; the
        next tokens go after them without a mask for dead slots. Where every entry that goes precedes the waiting
        steps' tokens (``EvictionPolicy.victims_precede_newest``), those tokens take the slots of the entries that
        go; else the kept entries move forward in slot order."""
        drop = self.slots - keep
        newest = len(self._pending)  # the waiting steps' tokens: the last slots (read before they are scored)
        priority = self._priority()
        if self.live_range[0] < self.slots:  # a row holds dead slots
            priority = torch.where(self.live, priority, -math.inf)
        if self.policy.victims_precede_newest(drop, newest, keep) and self._room_is_contiguous():
            self._fill_victims_slots(priority.topk(drop, dim=-1, largest=False).indices)
        else:
            self._keep(best_in_slot_order(priority, keep))
        if self._has_room_for_step(self.dtype) and self._may_defer_scoring():
            # The next steps append to the room with their scoring waiting, as after any step that did: they need
            # not check again (and a compiled step after an eviction runs the graph of every other step).
            self._plain_steps, self._plain_view = self._plain_steps_left(), self.keys

    def _set_live_counts(self, live_by_group: dict[tuple[int, Allocated | None], int]) -> None:
        """Record each group's live count, the least and most padding, and the least and most count."""
        self.live_by_group = live_by_group
        self._quiet_steps = self._plain_steps = 0
        self._plain_view = None  # (so that no replaced storage stays held through it)
        pads, counts = [group[0] for group in live_by_group], live_by_group.values()
        self.pad_range = (min(pads), max(pads)) if live_by_group else (0, 0)
        self.live_range = (min(counts), max(counts)) if live_by_group else (0, 0)
        if self._growing_room and self.live_range[0] >= (self._fixed_target() or 0):
            self._growing_room = False  # every row is full: steps evict one token each, counted on the host

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

    def drop_dead(self) -> None:
        """Free the slots of dead entries when every row and head holds the same number of live ones."""
        least, most = self.live_range
        if least != most or self.slots == most:
            return
        order = torch.argsort((~self.live).to(torch.uint8), dim=-1, stable=True)[..., :most]
        self._keep(order)
