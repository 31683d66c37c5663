"""What a compressed cache keeps: its size (a budget or a ratio), protected tokens and scoring choices."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from decodekit._validation import check_int, check_real
from decodekit.cache.allocation import ALLOCATIONS
from decodekit.cache.size import EntryBytes
from decodekit.settings import (
    DEFAULT_RECENT_TOKENS,
    DEFAULT_SINK_TOKENS,
    ESTIMATE_FROM_SHARE,
    KV_BITS,
    KV_REPLAYS,
    KV_SCORINGS,
)

SCORING_BACKENDS = ("auto", "triton", "torch")
REPLAY_SCOPES = ("prompt", "chunk")  # what a replay chunk's attention is spread over (scoring="reconstruction")
# A layer's share of the tokens, when it is chosen by the allocation: it keeps ``count`` tokens per KV head
# when a uniform layer keeps ``base``, and ``count * target // base`` when a uniform layer keeps ``target``.
Allocated = tuple[int, int]


def default_eviction_interval(budget: int | None) -> int:
    """The ``eviction_interval`` a cache uses when told none: with a fixed ``budget``, a 32nd of it, from 8 to
    64 tokens, so that a row holds on average at least 98% of its budget between evictions while a large
    budget pays its eviction (a few dozen operators per layer) over more steps; 8 for a size that grows with
    the tokens seen (``compression_ratio``) or is counted in bytes.

    Example:
        >>> default_eviction_interval(128), default_eviction_interval(1024), default_eviction_interval(8192)
        (8, 32, 64)
        >>> default_eviction_interval(None)
        8
    """
    if budget is None or isinstance(budget, bool) or not isinstance(budget, int):
        return 8  # an invalid budget is reported by EvictionPolicy, naming it
    return min(64, max(8, budget // 32))


def check_cache_size(
    budget: object,
    compression_ratio: object,
    *,
    floor: int = DEFAULT_SINK_TOKENS + DEFAULT_RECENT_TOKENS,
    names: tuple[str, str] = ("budget", "compression_ratio"),
    floor_hint: str = "",
) -> tuple[int | None, float | None]:
    """Check a cache size, given as exactly one of a budget and a compression ratio, and return both.

    ``names`` are the two parameters as the caller's user knows them (``kv_budget``...). The budget
    is an integer >= ``floor`` (the sinks and the recent window); the ratio lies in [0, 1).

    Example:
        >>> check_cache_size(64, None)
        (64, None)
        >>> check_cache_size(None, 1.0, names=("kv_budget", "kv_compression_ratio"))
        Traceback (most recent call last):
        ...
        ValueError: kv_compression_ratio must be a number in [0, 1); got 1.0
    """
    budget_name, ratio_name = names
    if (budget is None) == (compression_ratio is None):
        raise ValueError(f"give exactly one of {budget_name} (tokens kept) and {ratio_name} (fraction evicted)")
    if budget is not None:
        hint = floor_hint or " (the sink and recent tokens it always keeps)"
        return check_int(budget_name, budget, floor, hint), None
    return None, check_real(ratio_name, compression_ratio, 0, 1, high_open=True)


@dataclass(frozen=True)
class EvictionPolicy:
    """What a layer keeps per row: sinks, a recent window, and the best-scored tokens up to a budget.

    ``budget`` (a token count) or ``compression_ratio`` (keep ``1 - ratio`` of the tokens seen)
    sets the size; both count a row's real tokens, never its padding. See
    :class:`~decodekit.cache.CompressedCache` for the other fields. Every field is checked on
    construction, with a ValueError that names it.

    Example:
        >>> EvictionPolicy(budget=64).target(seen=1000)
        64
        >>> EvictionPolicy(compression_ratio=0.75).target(seen=1000)
        250
        >>> EvictionPolicy(budget=8)
        Traceback (most recent call last):
        ...
        ValueError: budget must be an integer >= 36 (sink_tokens + recent_tokens = 4 + 32); got 8
    """

    budget: int | None = None
    compression_ratio: float | None = None
    sink_tokens: int = DEFAULT_SINK_TOKENS
    recent_tokens: int = DEFAULT_RECENT_TOKENS
    observation_window: int | None = None
    score_decay: float = 0.9
    pool_kernel: int = 1
    value_norm: bool = True
    scoring: str = "attention"
    reconstruction_chunk: int = 2048
    scoring_backend: str = "auto"
    eviction_interval: int = 8
    kv_bits: int | None = None
    kv_group_size: int = 32
    key_bits: int | None = None
    memory_fraction: float | None = None
    max_bytes: int | None = None
    entry_bytes: EntryBytes | None = None  # what a kept token costs: needed by memory_fraction and max_bytes
    allocation: str = "uniform"
    allocation_floor: float = 0.2  # under allocation="global" ("heads"), the least share of the even one a layer
    # (a layer's KV head) keeps
    replay_prefix: tuple[int, ...] = ()
    replay_overlap: int = 0
    replay_scope: str = "prompt"
    replay_output_norms: bool = False
    replay: str = "auto"
    residual_length: int | None = None  # with kv_bits 8, 5 or 4: the last tokens also held exact (None: recent_tokens)
    matched_layers: int = 0  # the first layers whose prompt entries are refit at its eviction (``matching.py``)

    def __post_init__(self) -> None:
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {', '.join(map(repr, ALLOCATIONS))}; got {self.allocation!r}")
        if self.allocation in ("global", "heads") and self.scoring != "reconstruction":
            raise ValueError(
                f"allocation={self.allocation!r} needs scoring='reconstruction': only reconstruction scores mean the "
                f"same in every layer and head (got scoring={self.scoring!r}); use allocation='uniform' with other "
                "scorings"
            )
        check_real("allocation_floor", self.allocation_floor, 0, 1)
        if self.kv_bits is not None and (self.kv_bits not in KV_BITS or isinstance(self.kv_bits, bool)):
            raise ValueError(
                f"kv_bits must be one of {', '.join(map(str, KV_BITS))} or None (the model's dtype); "
                f"got {self.kv_bits!r}"
            )
        check_int("kv_group_size", self.kv_group_size, 1)
        if self.key_bits is not None:
            if self.key_bits not in KV_BITS or isinstance(self.key_bits, bool):
                raise ValueError(
                    f"key_bits must be one of {', '.join(map(str, KV_BITS))} or None; got {self.key_bits!r}"
                )
            if self.kv_bits is None:
                raise ValueError("key_bits (the keys' width) needs kv_bits (the values' width)")
        if self.scoring not in KV_SCORINGS:
            raise ValueError(f"scoring must be one of {', '.join(map(repr, KV_SCORINGS))}; got {self.scoring!r}")
        if self.scoring_backend not in SCORING_BACKENDS:
            raise ValueError(
                f"scoring_backend must be one of {', '.join(map(repr, SCORING_BACKENDS))}; got {self.scoring_backend!r}"
            )
        checked = {
            "reconstruction_chunk": check_int("reconstruction_chunk", self.reconstruction_chunk, 1),
            "sink_tokens": check_int("sink_tokens", self.sink_tokens, 0),
            "recent_tokens": check_int("recent_tokens", self.recent_tokens, 1),
            "pool_kernel": check_int("pool_kernel", self.pool_kernel, 1),
            "score_decay": check_real("score_decay", self.score_decay, 0, 1),
            "eviction_interval": check_int("eviction_interval", self.eviction_interval, 1),
        }
        checked["matched_layers"] = check_int("matched_layers", self.matched_layers, 0)
        if checked["matched_layers"] and self.scoring != "reconstruction":
            raise ValueError(
                f"matched_layers needs scoring='reconstruction' (its entries are refit for the prompt's queries placed "
                f"after the prompt, once the prompt is scored); got scoring={self.scoring!r} with matched_layers="
                f"{self.matched_layers}: use matched_layers=0"
            )
        if self.residual_length is not None:
            checked["residual_length"] = check_int(
                "residual_length", self.residual_length, 0, " or None (recent_tokens)"
            )
        if self.observation_window is not None:
            checked["observation_window"] = check_int(
                "observation_window", self.observation_window, 1, " or None (every query)"
            )
        checked.update(self._checked_replay(checked["reconstruction_chunk"]))
        if checked["pool_kernel"] % 2 == 0:
            raise ValueError(f"pool_kernel must be odd; got {self.pool_kernel}")
        floor = checked["sink_tokens"] + checked["recent_tokens"]
        hint = f" (sink_tokens + recent_tokens = {self.sink_tokens} + {self.recent_tokens})"
        if self.memory_fraction is None and self.max_bytes is None:
            checked["budget"], checked["compression_ratio"] = check_cache_size(
                self.budget, self.compression_ratio, floor=floor, floor_hint=hint
            )
        else:
            checked.update(self._checked_byte_size())
        for name, value in checked.items():  # plain Python numbers, whatever number types were given
            object.__setattr__(self, name, value)

    def _checked_replay(self, chunk: int) -> dict[str, object]:
        """Check how the prompt is replayed (``scoring="reconstruction"``): the prefix's token ids, the overlap
        and the scope."""
        if self.replay_scope not in REPLAY_SCOPES:
            raise ValueError(
                f"replay_scope must be one of {', '.join(map(repr, REPLAY_SCOPES))}; got {self.replay_scope!r}"
            )
        if self.replay not in KV_REPLAYS:
            raise ValueError(f"replay must be one of {', '.join(map(repr, KV_REPLAYS))}; got {self.replay!r}")
        if self.replay == "prompt_queries":
            self._check_replay_estimate()
        prefix = self.replay_prefix
        if isinstance(prefix, torch.Tensor):
            prefix = prefix.flatten().tolist()
        if isinstance(prefix, (str, bytes)) or not hasattr(prefix, "__iter__"):
            raise ValueError(f"replay_prefix must be a sequence of token ids (ints >= 0); got {prefix!r}")
        prefix = tuple(check_int("replay_prefix", token, 0, " (a token id)") for token in prefix)
        overlap = check_int("replay_overlap", self.replay_overlap, 0)
        if overlap >= chunk:
            raise ValueError(f"replay_overlap must be smaller than reconstruction_chunk ({chunk}); got {overlap}")
        return {"replay_prefix": prefix, "replay_overlap": overlap}

    def _estimate_needs(self) -> list[str]:
        """What ``replay="prompt_queries"`` needs and this policy lacks: it scores with every query of the prompt's
        pass, as a plain replay would, and replaces the layers' scores, so no other replay setting, no observation
        window, no uniform allocation."""
        needs = {
            "scoring='reconstruction'": self.scoring == "reconstruction",
            "allocation 'heads' or 'global'": self.allocation != "uniform",
            "observation_window=None": self.observation_window is None,
            "no replay_prefix": not self.replay_prefix,
            "replay_overlap=0": self.replay_overlap == 0,
            "replay_scope='prompt'": self.replay_scope == "prompt",
            "replay_output_norms=False": not self.replay_output_norms,
        }
        return [name for name, holds in needs.items() if not holds]

    def _check_replay_estimate(self) -> None:
        """Refuse ``replay="prompt_queries"`` where the estimate cannot stand for the replay, naming what it needs."""
        missing = self._estimate_needs()
        if missing:
            raise ValueError(
                f"replay='prompt_queries' (reconstruction scores without a replay pass) needs {', '.join(missing)}; "
                "use replay='forward' for the others"
            )

    def estimates_replay(self, length: int, rows: int = 1) -> bool:
        """Whether a prompt of ``length`` tokens in each of ``rows`` rows (reconstruction prompts have no padding)
        is scored by the estimate instead of a replay pass: always under ``replay="prompt_queries"``, never under
        ``"forward"``; under ``"auto"`` when the estimate applies (``_estimate_needs``) and the heads keep on
        average at least ``ESTIMATE_FROM_SHARE`` of the prompt (a budget, ratio or byte size that keeps half the
        tokens or more). Host arithmetic only, as ``target``.

        Example:
            >>> def policy(ratio):
            ...     return EvictionPolicy(scoring="reconstruction", allocation="heads", compression_ratio=ratio)
            >>> policy(0.5).estimates_replay(100), policy(0.6).estimates_replay(100)
            (True, False)
        """
        if self.replay != "auto":
            return self.replay == "prompt_queries"
        if self._estimate_needs():
            return False
        return self.target(length, rows) >= ESTIMATE_FROM_SHARE * length

    def _checked_byte_size(self) -> dict[str, float | int]:
        """Check a size given in bytes (``memory_fraction`` or ``max_bytes``, and nothing else)."""
        sizes = {
            "budget": self.budget, "compression_ratio": self.compression_ratio,
            "memory_fraction": self.memory_fraction, "max_bytes": self.max_bytes,
        }  # fmt: skip
        given = [name for name, value in sizes.items() if value is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of budget (tokens kept), compression_ratio (fraction evicted), memory_fraction "
                f"(of a full 16-bit cache's bytes) and max_bytes (bytes held); got {' and '.join(given)}"
            )
        if self.entry_bytes is None:
            raise ValueError("memory_fraction and max_bytes need entry_bytes (CompressedCache computes it)")
        if self.memory_fraction is not None:
            return {"memory_fraction": check_real("memory_fraction", self.memory_fraction, 0, 1, low_open=True)}
        return {"max_bytes": check_int("max_bytes", self.max_bytes, 1)}

    @property
    def ranks_by_value_norm(self) -> bool:
        """Whether eviction ranks a score times its value's norm (``value_norm``; never under
        ``allocation="global"`` or ``"heads"``, whose reconstruction scores rank as they are, as KVzip ranks
        them)."""
        return self.value_norm and self.allocation == "uniform"

    @property
    def exact_recent(self) -> int:
        """How many last tokens quantized storage holds exact too (``residual_length``, else ``recent_tokens``)."""
        return self.recent_tokens if self.residual_length is None else self.residual_length

    @property
    def steps_keep_one_room(self) -> bool:
        """Whether decoding steps keep one storage of ``budget + 1`` slots: one eviction per step under a budget in
        tokens, each step's token taking the slot the last eviction freed (what CUDA graphs can capture).

        Example:
            >>> EvictionPolicy(budget=64, eviction_interval=1).steps_keep_one_room
            True
            >>> EvictionPolicy(budget=64).steps_keep_one_room, EvictionPolicy(compression_ratio=0.5).steps_keep_one_room
            (False, False)
        """
        return self.eviction_interval == 1 and self.budget is not None

    def victims_precede_newest(self, drop: int, newest: int, keep: int) -> bool:
        """Whether an eviction of ``drop`` entries per row down to ``keep``, whose last ``newest`` slots hold the
        newest tokens in order, takes no victim from its last ``drop`` slots: those are recent tokens (protected), and
        the slots before them hold at least ``drop`` entries that are not (``keep`` covers the sinks and recent tokens).
        The kept entries after the victims can then fill their slots (``storage.move_tail_into``).

        Example:
            >>> policy = EvictionPolicy(budget=128, sink_tokens=4, recent_tokens=32)
            >>> policy.victims_precede_newest(8, 8, 121), policy.victims_precede_newest(8, 7, 121)
            (True, False)
            >>> policy.victims_precede_newest(40, 40, 121), policy.victims_precede_newest(8, 8, 30)
            (False, False)
        """
        return 0 < drop <= min(newest, self.recent_tokens) and keep >= self.sink_tokens + self.recent_tokens

    @property
    def sized_in_bytes(self) -> bool:
        """Whether the size is a number of bytes (``memory_fraction`` or ``max_bytes``)."""
        return self.memory_fraction is not None or self.max_bytes is not None

    def fixed_target(self, rows: int = 1) -> int | None:
        """The target when it does not grow with the tokens seen (``budget``, ``max_bytes``), else None."""
        if self.budget is not None:
            return self.budget
        if self.max_bytes is not None:
            return max(self.entry_bytes.tokens_within(self.max_bytes / rows), self.floor)
        return None

    @property
    def floor(self) -> int:
        """The fewest tokens a ratio keeps: the sinks and the recent window."""
        return self.sink_tokens + self.recent_tokens

    def target(self, seen: int, rows: int = 1, allocated: Allocated | None = None) -> int:
        """How many tokens a row that has seen ``seen`` real tokens keeps (at most; fewer if it has fewer);
        ``rows`` is how many rows share ``max_bytes``; ``allocated`` is the layer's share (``Allocated``)."""
        fixed = self.fixed_target(rows)
        if fixed is not None:
            target = fixed
        elif self.memory_fraction is not None:
            entry = self.entry_bytes  # the same float64 arithmetic as ``targets``
            allowed = self.memory_fraction * seen * entry.full - seen * entry.biases_per_seen
            target = max(math.floor((allowed - entry.fixed) / entry.kept), self.floor)
        else:
            target = max(math.ceil((1.0 - self.compression_ratio) * seen), self.floor)
        if allocated is None:
            return target
        count, base = allocated
        return max(count * target // base, self.floor)

    def targets(self, seen: torch.Tensor, rows: int = 1, allocated: torch.Tensor | None = None) -> torch.Tensor:
        """``target`` for a tensor of per-row real-token counts (the same float64 arithmetic as ``target``);
        ``allocated``: each row's ``(count, base)``, shaped like ``seen`` plus a last dimension of 2."""
        fixed = self.fixed_target(rows)
        if fixed is not None:
            kept = torch.full_like(seen, fixed)
        elif self.memory_fraction is not None:
            entry = self.entry_bytes
            counted = seen.to(torch.float64)
            allowed = self.memory_fraction * counted * entry.full - counted * entry.biases_per_seen
            kept = torch.floor((allowed - entry.fixed) / entry.kept).to(seen.dtype)
        else:
            kept = torch.ceil((1.0 - self.compression_ratio) * seen.to(torch.float64)).to(seen.dtype)
        kept = kept.clamp(min=self.floor)
        if allocated is None:
            return kept
        count, base = allocated[..., 0].to(kept.dtype), allocated[..., 1].to(kept.dtype)
        return torch.div(count * kept, base, rounding_mode="floor").clamp(min=self.floor)

    def kept(self, live: int, seen: int, slack: int = 0, rows: int = 1, allocated: Allocated | None = None) -> int:
        """How many of ``live`` stored tokens a row that has seen ``seen`` real tokens keeps: all of them
        up to its target; over it, the target less ``slack`` (room for the next tokens), never below the floor.

        Example:
            >>> EvictionPolicy(budget=64).kept(live=65, seen=1000, slack=7)
            57
        """
        target = self.target(seen, rows, allocated)
        return live if live <= target else max(target - slack, self.floor)

    def kept_counts(
        self,
        live: torch.Tensor,
        seen: torch.Tensor,
        slack: int = 0,
        rows: int = 1,
        allocated: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``kept`` for tensors of per-row live and real-token counts."""
        targets = self.targets(seen, rows, allocated)
        return torch.where(live <= targets, live, (targets - slack).clamp(min=self.floor))

    def slack(self, new: int) -> int:
        """How far below its target a row evicts after a pass of ``new`` tokens: one decoding step
        evicts ``eviction_interval`` tokens at once (so the next steps evict nothing), a longer pass
        evicts down to the target."""
        return self.eviction_interval - 1 if new == 1 else 0
