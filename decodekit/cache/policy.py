"""How many tokens a row keeps: its target under a budget, a ratio or a size in bytes, and its share under a
shared allocation.

All of it is host arithmetic on numbers or NumPy arrays, so that no decision reads the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from decodekit.cache.options import SizeOptions
from decodekit.cache.size import EntryBytes, reserved_room


@dataclass(frozen=True)
class EvictionPolicy:
    """Each row's target: ``size.budget`` tokens, ``1 - compression_ratio`` of the real tokens seen, or as many as
    ``memory_fraction`` or ``max_bytes`` hold (``entry_bytes``: what a kept token costs); never below the sinks and
    the recent window (the floor). Under a shared allocation a (row, KV head) keeps ``count * target // base``,
    its share (``count``) of the even share it was given from (``base``), at least ``allocation_floor`` of it.

    Example:
        >>> EvictionPolicy(SizeOptions(budget=64)).target(seen=1000)
        64
        >>> EvictionPolicy(SizeOptions(compression_ratio=0.75)).target(seen=1000)
        250
        >>> EvictionPolicy(SizeOptions(budget=64, eviction_interval=8)).kept(live=65, seen=1000, new=1)
        57
    """

    size: SizeOptions
    entry_bytes: EntryBytes | None = None
    allocation_floor: float = 0.2
    # ``targets``' answers by their question: every layer asks the same one at a step, and a step the one before it.
    _answers: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.size.in_bytes and self.entry_bytes is None:
            raise ValueError("memory_fraction and max_bytes need entry_bytes (CompressedCache computes it)")

    @property
    def floor(self) -> int:
        """The fewest tokens a row keeps: the sinks and the recent window."""
        return self.size.sink_tokens + self.size.recent_tokens

    @property
    def interval(self) -> int:
        """Tokens a decoding step evicts at once."""
        return self.size.eviction_interval or 8

    def fixed_target(self, rows: int = 1) -> int | None:
        """The target when it does not grow with the tokens seen (``budget``, ``max_bytes``), else None."""
        if self.size.budget is not None:
            return self.size.budget
        if self.size.max_bytes is not None:
            return max(self.entry_bytes.tokens_within(self.size.max_bytes / rows), self.floor)
        return None

    def target(self, seen: int, rows: int = 1, cap: int | None = None) -> int:
        """How many tokens a row that has seen ``seen`` real tokens keeps (at most); ``rows`` share ``max_bytes``;
        ``cap``: the layer's most (a sliding window's ``window - 1``)."""
        return int(self.targets(np.array([seen]), rows, cap)[0])

    def targets(self, seen: np.ndarray, rows: int = 1, cap: int | None = None) -> np.ndarray:
        """``target`` of each row of ``seen`` (host ``[batch]`` real tokens seen), float64 arithmetic. A layer with a
        ``cap`` (a sliding window's ``window - 1``: what transformers' own cache holds there) keeps at most that: a
        budget and a byte size are met within it, a ratio is of what the window holds. The array returned is
        read-only (it is shared with later calls that ask the same)."""
        seen = np.asarray(seen, dtype=np.int64)
        question = (seen.tobytes(), seen.shape, rows, cap)
        answer = self._answers.get(question)
        if answer is None:
            if len(self._answers) >= 1024:
                self._answers.clear()
            answer = self._targets(seen, rows, cap)
            answer.setflags(write=False)
            self._answers[question] = answer
        return answer

    def _targets(self, seen: np.ndarray, rows: int, cap: int | None) -> np.ndarray:
        fixed = self.fixed_target(rows)
        if fixed is not None:
            kept = np.full_like(seen, fixed)
        elif self.size.memory_fraction is not None:
            entry = self.entry_bytes
            counted = seen.astype(np.float64)
            allowed = self.size.memory_fraction * entry.held(counted) * entry.full - counted * entry.biases_per_seen
            tokens = entry.tokens_for((allowed - entry.fixed) / entry.kept)
            kept = np.floor(np.minimum(tokens, 2.0**62)).astype(np.int64)
        else:
            held = seen if cap is None else np.minimum(seen, cap)
            kept = np.ceil((1.0 - self.size.compression_ratio) * held.astype(np.float64)).astype(np.int64)
        if cap is None:
            return np.maximum(kept, self.floor)
        return np.minimum(np.maximum(kept, min(self.floor, cap)), cap)

    def check_room(self, windows: list[int | None]) -> None:
        """Refuse a size in bytes that can never hold the sinks and the recent window (``floor`` tokens, or a window's
        all where it holds fewer) of every layer: ``max_bytes`` for one row, and ``memory_fraction`` where every layer
        has a sliding window (the full cache then stops growing at its windows); the message names the option, the
        model's window and the smallest allowed value."""
        entry = self.entry_bytes
        floor = np.array([float(self.floor)])
        needed = float(entry.held(floor)[0]) * (entry.kept + entry.biases_per_kept) + entry.fixed  # per (layer, head)
        shortest = min((window for window in windows if window is not None), default=None)
        what = f"the sinks and the recent window ({self.floor} tokens per layer and KV head"
        shorter = shortest is not None and shortest - 1 < self.floor
        what += f", or a sliding window's {shortest - 1} where it is shorter)" if shorter else ")"
        if self.size.max_bytes is not None and self.size.max_bytes < needed * entry.units:
            raise ValueError(
                f"max_bytes={self.size.max_bytes} cannot hold {what}: the smallest allowed is "
                f"{math.ceil(needed * entry.units)}"
            )
        if self.size.memory_fraction is None or any(window is None for window in windows):
            return
        # the full cache's bytes per (layer, head), at most
        most = entry.full * float(entry.held(np.array([np.inf]))[0])
        least = needed / most
        if self.size.memory_fraction < least:
            smallest = f"the smallest allowed is {least:.3g}" if least <= 1 else "no memory_fraction fits this model"
            raise ValueError(
                f"memory_fraction={self.size.memory_fraction} leaves no room for {what} on a model whose every layer "
                f"holds its sliding window of {shortest} tokens: {smallest} (use a budget or a compression_ratio)"
            )

    def shared(self, targets: np.ndarray, counts: np.ndarray, bases: np.ndarray) -> np.ndarray:
        """Per row and head, ``[batch, heads]``: the target under a shared allocation that gave a (row, head)
        ``counts`` tokens where the even share was ``bases`` (``[batch]``), at a row target of ``targets`` (``[...,
        batch]``: leading dimensions give as many ``[..., batch, heads]``)."""
        return np.maximum(counts * targets[..., None] // bases[:, None], self.floor)

    def slack(self, new: int) -> int:
        """How far below its target a row evicts after a pass of ``new`` tokens: a decoding step evicts
        ``eviction_interval`` tokens at once (so the next steps evict nothing); a longer pass evicts to the target."""
        return self.interval - 1 if new == 1 else 0

    def kept(self, live: int, seen: int, new: int = 1, rows: int = 1) -> int:
        """How many of ``live`` stored tokens a row that has seen ``seen`` real tokens keeps after a pass of ``new``:
        all of them up to its target; over it, the target less the slack, never below the floor."""
        target = self.target(seen, rows)
        return live if live <= target else max(target - self.slack(new), self.floor)

    def kept_counts(
        self, lengths: np.ndarray, targets: np.ndarray, new: int, interval: int | None = None
    ) -> np.ndarray:
        """``kept`` for host arrays of lengths and targets of the same shape (``interval``: the layer's own, where it
        evicts at other intervals)."""
        slack = (self.interval if interval is None else interval) - 1 if new == 1 else 0
        floor = np.minimum(targets, self.floor)  # (a window smaller than the floor keeps what it holds)
        return np.where(lengths <= targets, lengths, np.maximum(targets - slack, floor))

    def keeps_one_room(self) -> bool:
        """Whether decoding steps keep one storage of ``budget + 1`` slots: one eviction per step under a budget in
        tokens, each step's token taking the slot its eviction frees (what compiled steps and CUDA graphs capture).

        Example:
            >>> EvictionPolicy(SizeOptions(budget=64, eviction_interval=1)).keeps_one_room()
            True
        """
        return self.interval == 1 and self.size.budget is not None

    def growth_room(self) -> int:
        """Slots a segment that must grow gets beyond what it needs (``size.reserved_room``): one per step until the
        next eviction, at least ``GROWTH_ROOM`` where the target grows with the tokens seen (a copy of the layer's
        storage every few steps of growth, not at every one)."""
        return reserved_room(self.interval, grows=self.fixed_target() is None)
