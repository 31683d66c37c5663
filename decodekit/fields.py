"""The one table of decoding fields: what a Strategy can set, and the processors they configure.

Each :class:`Field` says its name, kind, allowed values (from ``decodekit.settings``, where the
components that check them take them too), help text, family, command-line flag and demo widget.
``Strategy`` validates and labels from it, the command line builds its flags from it, the demo its
controls, the evaluation its report columns, and a test checks the README lists every field.

Each :class:`Component` is one decodekit logits processor and the fields that configure it; its
``build`` names a function in the processor's own module that makes the processor from a
Strategy's values. Adding a sampler is its module plus one ``Component`` row here.

The table imports no torch, so the command line can show it before loading anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from decodekit._validation import check_int, check_real, in_interval, interval, is_bool
from decodekit.settings import (
    ADAPTIVE_P_DECAY_RANGE,
    ALPHA_RANGE,
    DEFAULT_RECENT_TOKENS,
    DEFAULT_SINK_TOKENS,
    DRY_BASE_RANGE,
    DRY_MAX_MATCH,
    DRY_MULTIPLIER_RANGE,
    EARLY_STOPPING,
    KV_BITS,
    KV_REPLAYS,
    KV_SCORINGS,
    MAX_BEAMS,
    MIN_K_EXPONENT_RANGE,
    MIROSTAT_ETA_RANGE,
    MIROSTAT_TAU_RANGE,
    NORMALIZATIONS,
    P_LESS_ORDER_RANGE,
    PENALTY_RANGE,
    REWARD_RANGE,
    TEMPERATURE_RANGE,
    TOP_N_SIGMA_RANGE,
)

FAMILIES = ("sampling", "penalty", "beam", "cache")
KINDS = ("real", "integer", "text", "texts", "choice", "flag")


@dataclass(frozen=True)
class Field:
    """One decoding field of a Strategy.

    Attributes:
        name: the Strategy field (``top_p``); the flag is ``--top-p`` unless ``flag`` says otherwise.
        kind: "real", "integer", "text", "texts" (a list of strings), "choice" or "flag" (a bool).
        family: "sampling" (sets sampling on; refused by beam search), "penalty", "beam" or "cache".
        help: one line for ``--help``, the demo and the README.
        low, high, low_open, high_open: the allowed interval of a number.
        choices: the allowed values of a choice.
        requires: a field that must be set for this one to apply (``penalty_window`` needs
            ``staged_penalty``).
        widget: the demo's control: "number", "text", "choice", or None to leave it out.
        off: a command-line (or grid-file) value that leaves the field unset, as ``--top-k 0`` does; a
            Strategy itself takes only values in range.
    """

    name: str
    kind: str
    family: str
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[Any, ...] = ()
    requires: str | None = None
    flag: str = ""
    widget: str | None = "number"
    off: Any = None

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def span(self) -> str:
        """The allowed values as messages and help texts show them: ``in (0, 1]``, ``>= 1``."""
        if self.kind == "choice":
            return "one of " + ", ".join(str(choice).lower() if isinstance(choice, bool) else str(choice)
                                         for choice in self.choices)  # fmt: skip
        if self.kind in ("real", "integer"):
            span = interval(self.low, self.high, low_open=self.low_open, high_open=self.high_open)
            return span if self.off is None else f"{span} (or {self.off:g}: off)"
        return ""

    def check(self, value: Any) -> Any:
        """``value`` in its canonical form (plain Python numbers), or ValueError naming the field."""
        if self.kind == "real":
            return check_real(self.name, value, self.low, self.high, low_open=self.low_open, high_open=self.high_open)
        if self.kind == "integer":
            maximum = None if self.high is None else int(self.high)
            return check_int(self.name, value, int(self.low), maximum=maximum)
        if self.kind == "choice":
            if is_bool(value):
                value = bool(value)
            if not any(value is choice or (type(value) is type(choice) and value == choice) for choice in self.choices):
                raise ValueError(f"{self.name} must be {self.span}; got {value!r}")
            return value
        if self.kind == "texts":
            if isinstance(value, str) or not all(isinstance(item, str) and item for item in value):
                raise ValueError(f"{self.name} must be a list of non-empty strings; got {value!r}")
            return tuple(value)
        if self.kind == "flag":
            if not is_bool(value):
                raise TypeError(f"{self.name} must be True, False or None; got {value!r}")
            return bool(value)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{self.name} must be a non-empty string; got {value!r}")
        return value

    def parse(self, text: str) -> Any:
        """A command-line value: ValueError (without the flag's name, argparse adds it) when bad; None for
        the field's ``off`` value."""
        if self.kind in ("real", "integer"):
            number = _int_or_none(text) if self.kind == "integer" else _float_or_none(text)
            if number is None:
                raise ValueError(f"expected {'an integer' if self.kind == 'integer' else 'a number'}, got {text!r}")
            if self.off is not None and number == self.off:
                return None
            if not in_interval(number, self.low, self.high, low_open=self.low_open, high_open=self.high_open):
                raise ValueError(f"must be {self.span}; got {text}")
            return number
        if self.kind == "choice":
            spelled = {str(choice).lower(): choice for choice in self.choices}
            if text.lower() not in spelled:
                raise ValueError(f"must be {self.span}; got {text!r}")
            return spelled[text.lower()]
        if self.kind == "texts":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                items = None
            if not isinstance(items, list) or not all(isinstance(item, str) and item for item in items):
                raise ValueError(f'must be a JSON list of strings, like \'["\\\\n", ":"]\'; got {text!r}')
            return tuple(items)
        return text


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class Component:
    """One decodekit logits processor and the fields that configure it.

    ``switch`` is the field whose presence turns the processor on; ``build`` is
    ``"module:function"``, a function ``(values, context) -> LogitsProcessor`` in the processor's
    own module (``values`` holds the Strategy's settings of this component's fields).
    """

    name: str
    fields: tuple[Field, ...]
    build: str
    switch: str = ""

    @property
    def switch_field(self) -> str:
        return self.switch or self.fields[0].name


KV_FLOOR = DEFAULT_SINK_TOKENS + DEFAULT_RECENT_TOKENS

# Fields generate itself handles (its sampling switches, the beam decoder, the cache).
CORE_FIELDS = (
    Field("temperature", "real", "sampling", "sampling temperature", *TEMPERATURE_RANGE),
    Field("top_k", "integer", "sampling", "sample among the k most likely tokens", 1, off=0),
    Field(
        "top_p", "real", "sampling", "nucleus sampling: the smallest set reaching this mass", 0.0, 1.0, low_open=True
    ),
    Field("num_beams", "integer", "beam", "beam search with this many beams (does not sample)", 1, MAX_BEAMS),
    Field(
        "length_normalization",
        "choice",
        "beam",
        "how a finished hypothesis is scored: none (sum of "
        "log-probs), average (sum / L^alpha, the default) or gnmt (sum / ((5 + L) / 6)^alpha)",
        choices=NORMALIZATIONS,
        requires="num_beams",
        widget="choice",
    ),
    Field(
        "length_alpha", "real", "beam", "exponent of the length normalization (1.0)", *ALPHA_RANGE, requires="num_beams"
    ),
    Field(
        "length_reward",
        "real",
        "beam",
        "reward per generated token added to beam scores",
        *REWARD_RANGE,
        requires="num_beams",
        widget=None,
    ),
    Field(
        "early_stopping",
        "choice",
        "beam",
        "when beam search stops: true, false (heuristic, the default) or never (exhaustive)",
        choices=EARLY_STOPPING,
        requires="num_beams",
        widget=None,
    ),
    Field(
        "kv_budget",
        "integer",
        "cache",
        f"compressed KV cache keeping this many tokens per layer and KV head "
        f"(>= {KV_FLOOR}: the sinks and recent window)",
        KV_FLOOR,
    ),
    Field(
        "kv_compression_ratio",
        "real",
        "cache",
        "compressed KV cache evicting this fraction of the tokens",
        0.0,
        1.0,
        high_open=True,
        flag="--kv-ratio",
        widget=None,
    ),
    Field(
        "kv_memory_fraction",
        "real",
        "cache",
        "compressed KV cache holding at most this fraction of a full 16-bit cache's bytes "
        "(tokens kept chosen to fit, with kv_bits)",
        0.0,
        1.0,
        low_open=True,
        flag="--kv-memory",
    ),
    Field(
        "kv_bits",
        "choice",
        "cache",
        "compressed KV cache storing keys and values in 16, 8, 5, 4, 3 or 2 bits (alone: every token kept)",
        choices=KV_BITS,
        widget="choice",
    ),
    Field(
        "kv_scoring",
        "choice",
        "cache",
        "how the compressed cache ranks tokens: attention (the default), reconstruction (replays the prompt; "
        "one budget shared by all layers and KV heads) or attention+novelty (with a cache size)",
        choices=KV_SCORINGS,
        widget="choice",
    ),
    Field(
        "kv_replay",
        "choice",
        "cache",
        "how kv_scoring=reconstruction scores the prompt: auto (the default: prompt_queries where a head keeps half "
        "the prompt or more or the model has sliding windows, else forward), forward (the prompt fed again) or "
        "prompt_queries (estimated in the prompt's own pass: about half the prefill time)",
        choices=KV_REPLAYS,
        requires="kv_scoring",
        widget=None,
    ),
    Field(
        "kv_matched_layers",
        "integer",
        "cache",
        "how many of the first layers refit what kv_scoring=reconstruction keeps of the prompt (attention "
        "matching: a log-mass bias and a fitted value per kept entry; 1 by default, 0 for none)",
        0,
        requires="kv_scoring",
        widget=None,
    ),
    Field(
        "prefill_chunk",
        "integer",
        "cache",
        "read the prompt in chunks of this many tokens (generate's prefill_chunk_size): a compressed KV cache "
        "evicts after each chunk (with kv_scoring=reconstruction, once the chunk is replayed), so it never holds "
        "more than its size and one chunk",
        1,
    ),
    Field(
        "kv_eviction_interval",
        "integer",
        "cache",
        "compressed KV cache evicting this many tokens at once while decoding (by default a 32nd of a budget, "
        "8 to 64; 8 for a ratio)",
        1,
        widget=None,
    ),
    Field(
        "kv_residual_length",
        "integer",
        "cache",
        "compressed KV cache in 8, 5, 4, 3 or 2 bits also holding this many of the last tokens exact (by default the "
        "recent window; none with kv_scoring=reconstruction and kv_memory_fraction)",
        0,
        widget=None,
    ),
)

# A compressed cache takes one size; the CLI refuses two.
CACHE_SIZES = ("kv_budget", "kv_compression_ratio", "kv_memory_fraction")

# decodekit's processors, in the order they run (before generate's temperature, top-k and top-p).
COMPONENTS = (
    Component(
        "staged_penalty",
        (
            Field(
                "staged_penalty",
                "text",
                "penalty",
                'penalty by recurrence count in the window, e.g. "1:1.2,3:1.5,6:2.0"',
                widget="text",
            ),
            Field(
                "penalty_window",
                "integer",
                "penalty",
                "how many recent tokens the staged penalty counts (all)",
                1,
                requires="staged_penalty",
                widget=None,
            ),
        ),
        "decodekit.logits_processors.repetition:from_strategy",
    ),
    Component(
        "frequency_presence",
        (
            Field(
                "frequency_penalty",
                "real",
                "penalty",
                "subtracted per occurrence in the generated text",
                *PENALTY_RANGE,
                widget=None,
            ),
            Field(
                "presence_penalty",
                "real",
                "penalty",
                "subtracted once a token was generated",
                *PENALTY_RANGE,
                widget=None,
            ),
        ),
        "decodekit.logits_processors.frequency:from_strategy",
    ),
    Component(
        "dry",
        (
            Field(
                "dry_multiplier",
                "real",
                "penalty",
                "DRY: penalize extending a repeated sequence by multiplier * base^(match - allowed length)",
                *DRY_MULTIPLIER_RANGE,
                low_open=True,
            ),
            Field(
                "dry_base",
                "real",
                "penalty",
                "DRY: growth per extra matched token (1.75)",
                *DRY_BASE_RANGE,
                requires="dry_multiplier",
                widget=None,
            ),
            Field(
                "dry_allowed_length",
                "integer",
                "penalty",
                "DRY: longest repetition left alone (2)",
                1,
                DRY_MAX_MATCH,
                requires="dry_multiplier",
                widget=None,
            ),
            Field(
                "dry_penalty_last_n",
                "integer",
                "penalty",
                "DRY: how many recent tokens are searched (1024)",
                1,
                requires="dry_multiplier",
                widget=None,
            ),
            Field(
                "dry_sequence_breakers",
                "texts",
                "penalty",
                'DRY: strings that end a match (default ["\\n", ":", "\\"", "*"])',
                requires="dry_multiplier",
                widget=None,
            ),
        ),
        "decodekit.logits_processors.dry:from_strategy",
    ),
    Component(
        "top_n_sigma",
        (
            Field(
                "top_n_sigma",
                "real",
                "sampling",
                "keep logits within n standard deviations of the best",
                *TOP_N_SIGMA_RANGE,
            ),
        ),
        "decodekit.logits_processors.top_n_sigma:from_strategy",
    ),
    Component(
        "min_k",
        (
            Field(
                "min_k",
                "real",
                "sampling",
                "Min-k: keep the tokens above the largest drop of the sorted logits weighted by rank^-min_k "
                "(1: the published 1 / rank; the same tokens at every temperature)",
                *MIN_K_EXPONENT_RANGE,
            ),
        ),
        "decodekit.logits_processors.min_k:from_strategy",
    ),
    Component(
        "min_p",
        (
            Field(
                "min_p",
                "real",
                "sampling",
                "keep tokens at least min_p times as likely as the best (at the temperature)",
                0.0,
                1.0,
            ),
        ),
        "decodekit.logits_processors.min_p:from_strategy",
    ),
    Component(
        "top_h",
        (
            Field(
                "top_h",
                "real",
                "sampling",
                "Top-H: keep the likeliest tokens within this share of the entropy",
                0.0,
                1.0,
                low_open=True,
            ),
        ),
        "decodekit.logits_processors.top_h:from_strategy",
    ),
    Component(
        "p_less",
        (
            Field(
                "p_less",
                "real",
                "sampling",
                "p-less: keep tokens at least as likely as two draws agree (the Rényi order: 2 is p-less)",
                *P_LESS_ORDER_RANGE,
                low_open=True,
            ),
        ),
        "decodekit.logits_processors.p_less:from_strategy",
    ),
    Component(
        "typical_p",
        (
            Field(
                "typical_p",
                "real",
                "sampling",
                "locally typical sampling: keep this mass of the most typical tokens",
                0.0,
                1.0,
                low_open=True,
            ),
        ),
        "decodekit.logits_processors.typical:from_strategy",
    ),
    Component(
        "epsilon_cutoff",
        (
            Field(
                "epsilon_cutoff",
                "real",
                "sampling",
                "epsilon sampling: keep tokens at least this likely",
                0.0,
                1.0,
                low_open=True,
                high_open=True,
            ),
        ),
        "decodekit.logits_processors.epsilon:from_strategy",
    ),
    Component(
        "eta_cutoff",
        (
            Field(
                "eta_cutoff",
                "real",
                "sampling",
                "eta sampling: keep tokens at least min(eta, sqrt(eta) exp(-entropy)) likely",
                0.0,
                1.0,
                low_open=True,
                high_open=True,
            ),
        ),
        "decodekit.logits_processors.eta:from_strategy",
    ),
    Component(
        "xtc",
        (
            Field("xtc_threshold", "real", "sampling", "XTC: tokens at least this likely are top choices", 0.0, 1.0),
            Field(
                "xtc_probability",
                "real",
                "sampling",
                "XTC: chance per step of removing all top choices but the least likely (0.5)",
                0.0,
                1.0,
                requires="xtc_threshold",
            ),
        ),
        "decodekit.logits_processors.xtc:from_strategy",
    ),
    Component(
        "mirostat",
        (
            Field(
                "mirostat_tau",
                "real",
                "sampling",
                "Mirostat v2: target surprise in bits (5.0 is usual)",
                *MIROSTAT_TAU_RANGE,
                low_open=True,
            ),
            Field(
                "mirostat_eta",
                "real",
                "sampling",
                "Mirostat v2: learning rate (0.1)",
                *MIROSTAT_ETA_RANGE,
                low_open=True,
                requires="mirostat_tau",
            ),
        ),
        "decodekit.logits_processors.mirostat:from_strategy",
    ),
    Component(
        "adaptive_p",
        (
            Field(
                "adaptive_p",
                "real",
                "sampling",
                "Adaptive-P: favour tokens near this probability, adapting to what was drawn (last in the chain)",
                0.0,
                1.0,
            ),
            Field(
                "adaptive_p_decay",
                "real",
                "sampling",
                "Adaptive-P: weight of the past in the average of drawn probabilities (0.9)",
                *ADAPTIVE_P_DECAY_RANGE,
                requires="adaptive_p",
            ),
        ),
        "decodekit.logits_processors.adaptive_p:from_strategy",
    ),
)

FIELDS: tuple[Field, ...] = (
    *CORE_FIELDS[:3],
    *(field for component in COMPONENTS for field in component.fields),
    *CORE_FIELDS[3:],
)
BY_NAME = {field.name: field for field in FIELDS}
SAMPLING_FIELDS = tuple(field.name for field in FIELDS if field.family == "sampling")
BEAM_FIELDS = tuple(field.name for field in FIELDS if field.family == "beam" and field.name != "num_beams")
