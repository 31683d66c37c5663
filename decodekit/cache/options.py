"""A compressed cache's options, in four groups (its size, its scoring, its storage, its replay), each checked when
made with an error that names the option and what it accepts, and the defaults they resolve to for a model.

``CompressedCache(model, memory_fraction=0.25)`` stays the one-line way in: every option also has a keyword of its
own, which ``group_options`` sorts into its group.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

import torch

from decodekit._validation import check_int, check_real
from decodekit.settings import CODED_BITS, DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS, KV_BITS, KV_REPLAYS

SCORING_BACKENDS = ("auto", "triton", "torch")
REPLAY_SCOPES = ("prompt", "chunk")  # what a replayed chunk's attention is spread over
ALLOCATION_NAMES = {"global": "layers"}  # earlier spellings of the allocations


def check_cache_size(
    budget: object,
    compression_ratio: object,
    *,
    floor: int = DEFAULT_SINK_TOKENS + DEFAULT_RECENT_TOKENS,
    names: tuple[str, str] = ("budget", "compression_ratio"),
) -> tuple[int | None, float | None]:
    """Check a cache size, given as exactly one of a budget and a compression ratio, and return both; ``names`` are
    the two parameters as the caller's user knows them (``kv_budget``...).

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
        return check_int(budget_name, budget, floor, " (the sink and recent tokens it always keeps)"), None
    return None, check_real(ratio_name, compression_ratio, 0, 1, high_open=True)


def _one_of(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed or isinstance(value, bool):
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


@dataclass(frozen=True)
class SizeOptions:
    """What the cache holds: exactly one size (``budget`` tokens per layer, row and KV head; ``compression_ratio``,
    the share of the tokens seen evicted; ``memory_fraction`` of a full 16-bit cache's bytes; ``max_bytes``), the
    tokens always kept (``sink_tokens`` first, ``recent_tokens`` last), how many tokens a decoding step evicts at
    once (``eviction_interval``; None: by size) and how the size is shared (``allocation``: "uniform", "layers" or
    "heads"; None: by scoring).

    Example:
        >>> SizeOptions(memory_fraction=0.25).memory_fraction
        0.25
        >>> SizeOptions(budget=8)
        Traceback (most recent call last):
        ...
        ValueError: budget must be an integer >= 36 (sink_tokens + recent_tokens = 4 + 32); got 8
    """

    budget: int | None = None
    compression_ratio: float | None = None
    memory_fraction: float | None = None
    max_bytes: int | None = None
    sink_tokens: int = DEFAULT_SINK_TOKENS
    recent_tokens: int = DEFAULT_RECENT_TOKENS
    eviction_interval: int | None = None
    allocation: str | None = None

    def __post_init__(self) -> None:
        from decodekit.cache.allocation import ALLOCATIONS

        checked: dict[str, Any] = {
            "sink_tokens": check_int("sink_tokens", self.sink_tokens, 0),
            "recent_tokens": check_int("recent_tokens", self.recent_tokens, 1),
        }
        if self.eviction_interval is not None:
            checked["eviction_interval"] = check_int("eviction_interval", self.eviction_interval, 1, " or None")
        if self.allocation is not None:
            allocation = ALLOCATION_NAMES.get(self.allocation, self.allocation)
            _one_of("allocation", allocation, tuple(ALLOCATIONS))
            checked["allocation"] = allocation
        sizes = {"budget": self.budget, "compression_ratio": self.compression_ratio,
                 "memory_fraction": self.memory_fraction, "max_bytes": self.max_bytes}  # fmt: skip
        given = [name for name, value in sizes.items() if value is not None]
        if len(given) > 1:
            raise ValueError(
                "give exactly one of budget (tokens kept), compression_ratio (fraction evicted), memory_fraction "
                f"(of a full 16-bit cache's bytes) and max_bytes (bytes held); got {' and '.join(given)}"
            )
        floor = checked["sink_tokens"] + checked["recent_tokens"]
        if self.budget is not None:
            hint = f" (sink_tokens + recent_tokens = {self.sink_tokens} + {self.recent_tokens})"
            checked["budget"] = check_int("budget", self.budget, floor, hint)
        if self.compression_ratio is not None:
            checked["compression_ratio"] = check_real("compression_ratio", self.compression_ratio, 0, 1,
                                                      high_open=True)  # fmt: skip
        if self.memory_fraction is not None:
            checked["memory_fraction"] = check_real("memory_fraction", self.memory_fraction, 0, 1, low_open=True)
        if self.max_bytes is not None:
            checked["max_bytes"] = check_int("max_bytes", self.max_bytes, 1)
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def given(self) -> bool:
        """Whether a size was given."""
        return any(value is not None for value in (self.budget, self.compression_ratio, self.memory_fraction,
                                                    self.max_bytes))  # fmt: skip

    @property
    def in_bytes(self) -> bool:
        """Whether the size counts bytes (``memory_fraction`` or ``max_bytes``)."""
        return self.memory_fraction is not None or self.max_bytes is not None


@dataclass(frozen=True)
class ScoringOptions:
    """How entries are ranked: ``method`` (a name in ``scorers.SCORERS``: "attention", "reconstruction",
    "attention+novelty"), the queries that score (the last ``observation_window`` of a pass; None: all), how much
    of a score carries over a pass (``score_decay``), a smoothing over neighbours (``pool_kernel``, odd), whether
    a score is weighed by its value's norm (``value_norm``), the kernels (``backend``) and how many of the first
    layers refit their prompt's kept entries (``matched_layers``; None: by method).

    Example:
        >>> ScoringOptions("reconstruction").method
        'reconstruction'
        >>> ScoringOptions(pool_kernel=4)
        Traceback (most recent call last):
        ...
        ValueError: pool_kernel must be odd; got 4
    """

    method: str = "attention"
    observation_window: int | None = None
    score_decay: float = 0.9
    pool_kernel: int = 1
    value_norm: bool = True
    backend: str = "auto"
    matched_layers: int | None = None

    def __post_init__(self) -> None:
        from decodekit.cache.scorers import SCORERS

        _one_of("scoring", self.method, tuple(SCORERS))
        _one_of("scoring_backend", self.backend, SCORING_BACKENDS)
        checked: dict[str, Any] = {
            "score_decay": check_real("score_decay", self.score_decay, 0, 1),
            "pool_kernel": check_int("pool_kernel", self.pool_kernel, 1),
        }
        if checked["pool_kernel"] % 2 == 0:
            raise ValueError(f"pool_kernel must be odd; got {self.pool_kernel}")
        if self.observation_window is not None:
            checked["observation_window"] = check_int("observation_window", self.observation_window, 1,
                                                      " or None (every query)")  # fmt: skip
        if self.matched_layers is not None:
            checked["matched_layers"] = check_int("matched_layers", self.matched_layers, 0, " or None")
        if not isinstance(self.value_norm, bool):
            raise ValueError(f"value_norm must be True or False; got {self.value_norm!r}")
        for name, value in checked.items():
            object.__setattr__(self, name, value)


@dataclass(frozen=True)
class StorageOptions:
    """How kept entries are stored: ``kv_bits`` per value (16, 8, 5, 4, 3 or 2; None: the model's dtype), keys in
    ``key_bits`` when given, coded in groups of ``group_size`` channels (None: 32, or the head size if smaller),
    with the last ``residual_length`` tokens also held exact (None: ``recent_tokens``, or by size); coded keys
    less their mean key (``smooth_keys``, SageAttention's smooth K; None: where the model normalizes its keys).

    Example:
        >>> StorageOptions(kv_bits=4, key_bits=8).key_bits
        8
        >>> StorageOptions(key_bits=8)
        Traceback (most recent call last):
        ...
        ValueError: key_bits (the keys' width) needs kv_bits (the values' width)
    """

    kv_bits: int | None = None
    key_bits: int | None = None
    group_size: int | None = None
    residual_length: int | None = None
    smooth_keys: bool | None = None

    def __post_init__(self) -> None:
        widths = ", ".join(map(str, KV_BITS))
        if self.smooth_keys is not None and not isinstance(self.smooth_keys, bool):
            raise ValueError(f"smooth_keys must be True, False or None (where the model normalizes its keys); got "
                             f"{self.smooth_keys!r}")
        if self.kv_bits is not None and (self.kv_bits not in KV_BITS or isinstance(self.kv_bits, bool)):
            raise ValueError(f"kv_bits must be one of {widths} or None (the model's dtype); got {self.kv_bits!r}")
        if self.key_bits is not None:
            if self.key_bits not in KV_BITS or isinstance(self.key_bits, bool):
                raise ValueError(f"key_bits must be one of {widths} or None; got {self.key_bits!r}")
            if self.kv_bits is None:
                raise ValueError("key_bits (the keys' width) needs kv_bits (the values' width)")
        if self.group_size is not None:
            object.__setattr__(self, "group_size", check_int("kv_group_size", self.group_size, 1))
        if self.residual_length is not None:
            object.__setattr__(self, "residual_length",
                               check_int("residual_length", self.residual_length, 0, " or None (recent_tokens)"))

    @property
    def coded(self) -> bool:
        """Whether keys or values are stored as integer codes (8, 5, 4, 3 or 2 bits)."""
        return bool({self.kv_bits, self.key_bits} & set(CODED_BITS))


@dataclass(frozen=True)
class ReplayOptions:
    """How reconstruction scores are had: ``mode`` "forward" (the prompt fed again in chunks of ``chunk`` tokens,
    each after ``prefix`` token ids and the previous chunk's last ``overlap`` tokens, its attention spread over
    ``scope`` "prompt" or "chunk", weighed by output norms with ``output_norms``), "prompt_queries" (estimated in
    the prompt's own pass) or "auto" (the estimate where heads keep at least half the prompt, or on a model with
    sliding-window layers, as a replay of the whole prompt in one chunk).

    Example:
        >>> ReplayOptions(chunk=512, overlap=8).overlap
        8
        >>> ReplayOptions(chunk=8, overlap=8)
        Traceback (most recent call last):
        ...
        ValueError: replay_overlap must be smaller than reconstruction_chunk (8); got 8
    """

    mode: str = "auto"
    chunk: int = 2048
    prefix: tuple[int, ...] = field(default=())
    overlap: int = 0
    scope: str = "prompt"
    output_norms: bool = False

    def __post_init__(self) -> None:
        _one_of("replay", self.mode, KV_REPLAYS)
        _one_of("replay_scope", self.scope, REPLAY_SCOPES)
        chunk = check_int("reconstruction_chunk", self.chunk, 1)
        prefix = self.prefix
        if isinstance(prefix, torch.Tensor):
            prefix = prefix.flatten().tolist()
        if isinstance(prefix, (str, bytes)) or not hasattr(prefix, "__iter__"):
            raise ValueError(f"replay_prefix must be a sequence of token ids (ints >= 0); got {prefix!r}")
        prefix = tuple(check_int("replay_prefix", token, 0, " (a token id)") for token in prefix)
        overlap = check_int("replay_overlap", self.overlap, 0)
        if overlap >= chunk:
            raise ValueError(f"replay_overlap must be smaller than reconstruction_chunk ({chunk}); got {overlap}")
        for name, value in (("chunk", chunk), ("prefix", prefix), ("overlap", overlap)):
            object.__setattr__(self, name, value)

    @property
    def plain(self) -> bool:
        """Whether every setting but the mode is its default (what an estimate of the replay can stand for)."""
        return not self.prefix and self.overlap == 0 and self.scope == "prompt" and not self.output_norms


# Each keyword of CompressedCache's, its group and its name there.
KEYWORDS = {
    "compression_ratio": ("size", "compression_ratio"),
    "memory_fraction": ("size", "memory_fraction"),
    "max_bytes": ("size", "max_bytes"),
    "sink_tokens": ("size", "sink_tokens"),
    "recent_tokens": ("size", "recent_tokens"),
    "eviction_interval": ("size", "eviction_interval"),
    "allocation": ("size", "allocation"),
    "observation_window": ("scoring", "observation_window"),
    "score_decay": ("scoring", "score_decay"),
    "pool_kernel": ("scoring", "pool_kernel"),
    "value_norm": ("scoring", "value_norm"),
    "scoring_backend": ("scoring", "backend"),
    "matched_layers": ("scoring", "matched_layers"),
    "kv_bits": ("storage", "kv_bits"),
    "key_bits": ("storage", "key_bits"),
    "kv_group_size": ("storage", "group_size"),
    "residual_length": ("storage", "residual_length"),
    "smooth_keys": ("storage", "smooth_keys"),
    "reconstruction_chunk": ("replay", "chunk"),
    "replay_prefix": ("replay", "prefix"),
    "replay_overlap": ("replay", "overlap"),
    "replay_scope": ("replay", "scope"),
    "replay_output_norms": ("replay", "output_norms"),
}
GROUPS = {"size": SizeOptions, "scoring": ScoringOptions, "storage": StorageOptions, "replay": ReplayOptions}


def group_options(
    budget: int | None,
    groups: dict[str, Any],
    keywords: dict[str, Any],
) -> dict[str, Any]:
    """The four groups, from those given (``groups``: an options object, a method or mode name for scoring and
    replay, or None) and the keywords of their options (``keywords``); TypeError for an unknown keyword, ValueError
    for one given twice.

    Example:
        >>> grouped = group_options(None, {"scoring": "reconstruction"}, {"memory_fraction": 0.25})
        >>> grouped["size"].memory_fraction, grouped["scoring"].method
        (0.25, 'reconstruction')
    """
    unknown = sorted(set(keywords) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"CompressedCache got unknown options {', '.join(unknown)}; it takes {', '.join(KEYWORDS)}")
    values: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
    if budget is not None:
        values["size"]["budget"] = budget
    for keyword, value in keywords.items():
        group, name = KEYWORDS[keyword]
        if value is None and _default(GROUPS[group], name) is None:
            continue  # None is that option's default: nothing given
        values[group][name] = value
    grouped = {}
    for name, options_type in GROUPS.items():
        given = groups.get(name)
        if isinstance(given, str):
            given = options_type(**{"method" if name == "scoring" else "mode": given})
        if given is None:
            grouped[name] = options_type(**values[name])
            continue
        if not isinstance(given, options_type):
            raise TypeError(f"{name} must be a {options_type.__name__}; got {given!r}")
        twice = [option for option in values[name] if getattr(given, option) != _default(options_type, option)]
        if twice:
            raise ValueError(f"{', '.join(twice)} given both as a keyword and in {name}={given!r}")
        grouped[name] = replace(given, **values[name]) if values[name] else given
    return grouped


def _default(options_type: type, name: str) -> Any:
    for option in fields(options_type):
        if option.name == name:
            return option.default_factory() if option.default is MISSING else option.default
    raise KeyError(name)


# Defaults chosen on the tuning texts with ``benchmarks/kv_bytes.py``: the least memory fraction at which a
# byte-sized cache stores keys in 8 bits and values in 4, per allocation; under "heads", the least at which it stores
# keys in 5 bits (else both in 4); the residual window it holds; and its eviction interval.
KEYS_IN_8_BITS_FROM = {"uniform": 0.45, "layers": 0.2, "heads": 0.45}
KEYS_IN_5_BITS_FROM = {"heads": 0.1}
# On a model with sliding-window layers, under "heads": keys in 4 bits and values in 2 below this fraction. Chosen on
# Gemma 3 270M's two tuning sets (mean perplexity rise, keys/values; a tenth of the bytes: 4/2 +9.08% / +8.76%, 5/4
# +20.87% / +10.89%, and on the first set 3/2 +9.48%, 5/2 +11.74%, 3/3 +12.14%; a quarter: 5/4 +0.35% / +0.52%, 4/4
# -0.01% / +0.98%, 4/3 +0.50%, 4/2 +1.20%) and kept off models without windows, where 2-bit values lost (SmolLM2 at a
# tenth: 4/2 +4.63%, 5/4 +0.86%; ``benchmarks/results/kv_low_bits_cpu.txt``).
VALUES_IN_2_BITS_WITH_WINDOWS_BELOW = 0.15
RESIDUAL_WHEN_SIZED_IN_BYTES = {"heads": 0}  # absent: recent_tokens
INTERVAL_WHEN_SIZED_IN_BYTES = {"heads": 1}  # absent: 8
MATCHED_LAYERS = {"reconstruction": 1}  # absent: 0
# On a model with sliding-window layers, the least compression_ratio at which reconstruction keeps every layer's even
# share by default (``default_allocation``), chosen on Gemma 3's two tuning sets (mean perplexity rise, 4 + 4 texts)
# and its retrieval tasks for choosing (multi-key in 2k tokens, seed 1; the full cache 4 of 5), shared against even:
# 50% evicted +0.98% / +1.24% against +4.28% / +1.53%; 75% +10.94% / +7.30% against +11.74% / +5.20%, retrieval 4
# against 0; 85% (the first set) +38.36% against +19.30%, retrieval with sharing 1 (3 at 80%); 90% +46.45% against
# +28.31%, retrieval 0 against 0.
EVEN_SHARES_WITH_WINDOWS_FROM = 0.85


def default_allocation(method: str, sliding_windows: bool = False, compression_ratio: float | None = None) -> str:
    """How the size is shared when told nothing: among KV heads by reconstruction scores (KVzip's allocation), except
    on a model with sliding-window layers told to evict a share of at least ``EVEN_SHARES_WITH_WINDOWS_FROM``, where
    every layer keeps its even share, as under the other scorings. There, sharing by replay scores gave the global
    layers most of the tokens and left the windowed layers their sinks and recent tokens; with fewer tokens evicted,
    sharing keeps pass keys that even shares lose (the global layers then rank by attention), and under a size in
    bytes the global layers nearly fill it (a quarter of the bytes +0.51% shared against +11.92% even;
    ``benchmarks/results/kv_gemma3_protocol_cpu.txt``).

    Example:
        >>> default_allocation("attention"), default_allocation("reconstruction")
        ('uniform', 'heads')
        >>> default_allocation("reconstruction", True, 0.75), default_allocation("reconstruction", True, 0.9)
        ('heads', 'uniform')
    """
    if method != "reconstruction":
        return "uniform"
    evicts_most = compression_ratio is not None and compression_ratio >= EVEN_SHARES_WITH_WINDOWS_FROM
    return "uniform" if sliding_windows and evicts_most else "heads"


def default_matched_layers(method: str) -> int:
    """How many of the first layers refit their prompt's kept entries when told none: 1 with reconstruction scores
    (it lowered the mean perplexity rise on the tuning texts at every size, +1.52% to +0.79% with 75% of the tokens
    evicted; two layers did no better), else 0 (refitting needs the prompt's queries placed after it).

    Example:
        >>> default_matched_layers("attention"), default_matched_layers("reconstruction")
        (0, 1)
    """
    return MATCHED_LAYERS.get(method, 0)


def byte_sized_widths(
    memory_fraction: float | None,
    allocation: str = "uniform",
    head_dim: int | None = None,
    sliding_windows: bool = False,
) -> tuple[int, int]:
    """``(kv_bits, key_bits)`` for a cache sized in bytes and told no widths: keys in 8 bits and values in 4 while
    evicting costs more than coarser codes, else both in 4 (more tokens beat more bits once many must go); under
    "heads", keys in 5 bits from a tenth of the bytes up (``KEYS_IN_5_BITS_FROM``; 5-bit codes pack eight channels
    at a time, so a ``head_dim`` that is not a multiple of 8 takes 4 bits); on a model with ``sliding_windows``,
    under "heads", keys in 4 bits and values in 2 below ``VALUES_IN_2_BITS_WITH_WINDOWS_BELOW`` (where 2-bit codes
    pack: a ``head_dim`` that is a multiple of 4).

    Example:
        >>> byte_sized_widths(0.5), byte_sized_widths(0.25), byte_sized_widths(None)
        ((4, 8), (4, 4), (4, 4))
        >>> byte_sized_widths(0.25, "layers"), byte_sized_widths(0.1, "layers")
        ((4, 8), (4, 4))
        >>> byte_sized_widths(0.5, "heads"), byte_sized_widths(0.25, "heads"), byte_sized_widths(0.05, "heads")
        ((4, 8), (4, 5), (4, 4))
        >>> byte_sized_widths(0.25, "heads", head_dim=12)
        (4, 4)
        >>> byte_sized_widths(0.25, "heads", 256, sliding_windows=True), byte_sized_widths(0.1, "heads", 256, True)
        ((4, 5), (2, 4))
    """
    if memory_fraction is None:
        return 4, 4
    if memory_fraction >= KEYS_IN_8_BITS_FROM.get(allocation, 0.45):
        return 4, 8
    packs_two = head_dim is None or head_dim % 4 == 0
    few_bytes = memory_fraction < VALUES_IN_2_BITS_WITH_WINDOWS_BELOW
    if sliding_windows and allocation == "heads" and packs_two and few_bytes:
        return 2, 4
    packs_five = head_dim is None or head_dim % 8 == 0
    return 4, 5 if packs_five and memory_fraction >= KEYS_IN_5_BITS_FROM.get(allocation, math.inf) else 4


def default_eviction_interval(budget: int | None) -> int:
    """The ``eviction_interval`` of a cache told none: with a fixed ``budget``, a 32nd of it, from 8 to 64 tokens
    (a row holds on average at least 98% of its budget between evictions while a large budget pays its eviction
    over more steps); 8 for a size that grows with the tokens seen.

    Example:
        >>> default_eviction_interval(128), default_eviction_interval(1024), default_eviction_interval(8192)
        (8, 32, 64)
        >>> default_eviction_interval(None)
        8
    """
    if budget is None:
        return 8
    return min(64, max(8, budget // 32))


@dataclass(frozen=True)
class ResolvedOptions:
    """The four groups with every default resolved for one model (what a cache's parts read), and whether that model
    has sliding-window layers (``sliding_windows``, which ``resolve`` is told)."""

    size: SizeOptions
    scoring: ScoringOptions
    storage: StorageOptions
    replay: ReplayOptions
    sliding_windows: bool = False

    @property
    def estimate_applies(self) -> list[str]:
        """What an estimate of the replay (``replay="prompt_queries"``) needs and these options lack."""
        needs = {
            "scoring='reconstruction'": self.scoring.method == "reconstruction",
            "allocation 'heads' or 'layers'": self.size.allocation != "uniform" or self.sliding_windows,
            "observation_window=None": self.scoring.observation_window is None,
            "no replay_prefix": not self.replay.prefix,
            "replay_overlap=0": self.replay.overlap == 0,
            "replay_scope='prompt'": self.replay.scope == "prompt",
            "replay_output_norms=False": not self.replay.output_norms,
        }
        return [name for name, holds in needs.items() if not holds]

    @property
    def ranks_by_value_norm(self) -> bool:
        """Whether eviction ranks a score times its value's norm (never under a shared allocation, whose
        reconstruction scores rank as they are, as KVzip ranks them)."""
        return self.scoring.value_norm and self.size.allocation == "uniform"


def resolve(grouped: dict[str, Any], head_dim: int | None, sliding_windows: bool = False) -> ResolvedOptions:
    """Fill in the defaults that depend on the other options, on the model's ``head_dim`` and on whether it has
    sliding-window layers, and check the options that depend on each other (the allocation by
    ``default_allocation``).

    Example:
        >>> options = resolve(group_options(None, {}, {"memory_fraction": 0.25, "scoring_backend": "torch"}), 64)
        >>> options.storage.kv_bits, options.storage.key_bits, options.size.eviction_interval
        (4, 4, 8)
    """
    size, scoring, storage, replay = (grouped[name] for name in GROUPS)
    method = scoring.method
    if not size.given and storage.kv_bits is not None:
        size = replace(size, compression_ratio=0.0)  # quantization alone: every token is kept
    if not size.given:
        raise ValueError("give exactly one of budget (tokens kept) and compression_ratio (fraction evicted)")
    allocation = size.allocation or default_allocation(method, sliding_windows, size.compression_ratio)
    if allocation != "uniform" and method != "reconstruction":
        raise ValueError(
            f"allocation={allocation!r} needs scoring='reconstruction': only reconstruction scores mean the same in "
            f"every layer and head (got scoring={method!r}); use allocation='uniform' with other scorings"
        )
    interval = size.eviction_interval
    if interval is None:
        interval = INTERVAL_WHEN_SIZED_IN_BYTES.get(allocation, 8) if size.in_bytes else \
            default_eviction_interval(size.budget)  # fmt: skip
    size = replace(size, allocation=allocation, eviction_interval=interval)
    kv_bits, key_bits = storage.kv_bits, storage.key_bits
    if size.in_bytes and kv_bits is None and key_bits is None:
        kv_bits, key_bits = byte_sized_widths(size.memory_fraction, allocation, head_dim, sliding_windows)
    residual = storage.residual_length
    if residual is None:
        residual = RESIDUAL_WHEN_SIZED_IN_BYTES.get(allocation, size.recent_tokens) if size.in_bytes else \
            size.recent_tokens  # fmt: skip
    group_size = storage.group_size or (min(32, head_dim) if head_dim else 32)
    storage = replace(storage, kv_bits=kv_bits, key_bits=key_bits, group_size=group_size, residual_length=residual)
    if head_dim:
        from decodekit.cache.quantize import Quantizer

        for bits in {kv_bits, key_bits} & set(CODED_BITS):  # each coded width's packing, checked now
            Quantizer(bits, group_size).groups(head_dim)
    matched = scoring.matched_layers
    if matched is None:
        matched = default_matched_layers(method)
    if matched and method != "reconstruction":
        raise ValueError(
            f"matched_layers needs scoring='reconstruction' (its entries are refit for the prompt's queries placed "
            f"after the prompt, once the prompt is scored); got scoring={method!r} with matched_layers={matched}: "
            "use matched_layers=0"
        )
    scoring = replace(scoring, matched_layers=matched)
    options = ResolvedOptions(size, scoring, storage, replay, sliding_windows)
    if replay.mode == "prompt_queries" and options.estimate_applies:
        raise ValueError(
            f"replay='prompt_queries' (reconstruction scores without a replay pass) needs "
            f"{', '.join(options.estimate_applies)}; use replay='forward' for the others"
        )
    return options
