"""How many tokens a row keeps: its target under a budget, a ratio or a size in bytes, and its share under a
shared allocation.

All of it is host arithmetic on numbers or NumPy arrays, so that no decision reads the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from decodekit.cache.options import SizeOptions
from decodekit.cache.size import EntryBytes


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

    def target(self, seen: int, rows: int = 1) -> int:
        """How many tokens a row that has seen ``seen`` real tokens keeps (at most); ``rows`` share ``max_bytes``."""
        return int(self.targets(np.array([seen]), rows)[0])

    def targets(self, seen: np.ndarray, rows: int = 1) -> np.ndarray:
        """``target`` of each row of ``seen`` (host ``[batch]`` real tokens seen), float64 arithmetic."""
        seen = np.asarray(seen, dtype=np.int64)
        fixed = self.fixed_target(rows)
        if fixed is not None:
            kept = np.full_like(seen, fixed)
        elif self.size.memory_fraction is not None:
            entry = self.entry_bytes
            counted = seen.astype(np.float64)
            allowed = self.size.memory_fraction * counted * entry.full - counted * entry.biases_per_seen
            kept = np.floor((allowed - entry.fixed) / entry.kept).astype(np.int64)
        else:
            kept = np.ceil((1.0 - self.size.compression_ratio) * seen.astype(np.float64)).astype(np.int64)
        return np.maximum(kept, self.floor)

    def shared(self, targets: np.ndarray, counts: np.ndarray, bases: np.ndarray) -> np.ndarray:
        """Per row and head, ``[batch, heads]``: the target under a shared allocation that gave a (row, head)
        ``counts`` tokens where the even share was ``bases`` (``[batch]``), at a row target of ``targets``."""
        return np.maximum(counts * targets[:, None] // bases[:, None], self.floor)

    def slack(self, new: int) -> int:
        """How far below its target a row evicts after a pass of ``new`` tokens: a decoding step evicts
        ``eviction_interval`` tokens at once (so the next steps evict nothing); a longer pass evicts to the target."""
        return self.interval - 1 if new == 1 else 0

    def kept(self, live: int, seen: int, new: int = 1, rows: int = 1) -> int:
        """How many of ``live`` stored tokens a row that has seen ``seen`` real tokens keeps after a pass of ``new``:
        all of them up to its target; over it, the target less the slack, never below the floor."""
        target = self.target(seen, rows)
        return live if live <= target else max(target - self.slack(new), self.floor)

    def kept_counts(self, lengths: np.ndarray, targets: np.ndarray, new: int) -> np.ndarray:
        """``kept`` for host arrays of lengths and targets of the same shape."""
        slack = self.slack(new)
        return np.where(lengths <= targets, lengths, np.maximum(targets - slack, self.floor))

    def keeps_one_room(self) -> bool:
        """Whether decoding steps keep one storage of ``budget + 1`` slots: one eviction per step under a budget in
        tokens, each step's token taking the slot its eviction frees (what compiled steps and CUDA graphs capture).

        Example:
            >>> EvictionPolicy(SizeOptions(budget=64, eviction_interval=1)).keeps_one_room()
            True
        """
        return self.interval == 1 and self.size.budget is not None

    def growth_room(self) -> int:
        """Slots a segment that must grow gets beyond what it needs: one per step until the next eviction, at least
        4 where the target grows with the tokens seen (a copy every few steps of growth, not at every one)."""
        return max(self.interval, 4) if self.fixed_target() is None else self.interval
