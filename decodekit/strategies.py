"""Strategy: one named decoding recipe, turned into a typed plan for ``model.generate``.

The CLI, the demo and the evaluation runner all build their generate calls from a Strategy, so
each recipe is written once. A Strategy states the whole recipe: a filter it does not name is
off, whatever defaults the model's ``generation_config`` carries (transformers would otherwise
apply top-k 50 to every sampling call). Its fields are the rows of ``decodekit.fields``: the
validation, the label and the processors all come from that table.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from decodekit._validation import is_bool
from decodekit.cache.options import check_cache_size
from decodekit.fields import BEAM_FIELDS, BY_NAME, CACHE_SIZES, COMPONENTS, FIELDS, SAMPLING_FIELDS
from decodekit.logits_processors import parse_stages
from decodekit.logits_processors.repetition import check_stage_table
from decodekit.plan import GenerationPlan, PlanContext
from decodekit.settings import CODED_BITS

# Options of eviction: they need one of the cache sizes.
CACHE_OPTIONS = ("kv_scoring", "kv_replay", "kv_matched_layers", "kv_eviction_interval")

__all__ = ["BEAM_FIELDS", "SAMPLING_FIELDS", "Strategy"]


def _canonical_stages(stages: str | Mapping[int, float]) -> str:
    """One text form for a stage table, so equal tables compare and hash equal."""
    table = check_stage_table(parse_stages(stages) if isinstance(stages, str) else stages, "staged_penalty")
    return ",".join(f"{count}:{penalty:g}" for count, penalty in table)


class Strategy:
    """A decoding recipe: greedy, sampling or beam search, with filters, penalties and a cache.

    Every field of ``decodekit.fields.FIELDS`` is a keyword argument (None or absent: unset), and
    reads back as an attribute. ``name`` labels the recipe in reports and the demo (derived from
    the fields when omitted); ``do_sample`` (None by default) means "sample when any sampling
    field is set". The README lists the fields with their ranges; the main ones:

    - sampling: ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``top_n_sigma``,
      ``xtc_threshold`` / ``xtc_probability``, ``mirostat_tau`` / ``mirostat_eta``;
    - penalties: ``staged_penalty`` (a stage table or ``"1:1.2,3:1.5"``) and ``penalty_window``,
      ``frequency_penalty``, ``presence_penalty``, ``dry_multiplier`` and its ``dry_*`` settings;
    - beam search: ``num_beams``, ``length_normalization``, ``length_alpha``, ``length_reward``,
      ``early_stopping``;
    - cache: ``kv_budget``, ``kv_compression_ratio`` or ``kv_memory_fraction``, ``kv_scoring``, ``kv_replay``,
      ``kv_matched_layers``, ``kv_eviction_interval``, ``kv_residual_length``, and ``kv_bits`` (a
      ``CompressedCache``; ``kv_bits`` alone quantizes every token).

    Values are checked on construction (a ValueError names the field, its range and the value)
    and stored as plain Python values; a Strategy is immutable and hashable.

    Example:
        >>> from decodekit import Strategy
        >>> Strategy().generate_kwargs()
        {'do_sample': False}
        >>> Strategy(temperature=0.7, top_p=0.9).generate_kwargs()
        {'do_sample': True, 'temperature': 0.7, 'top_k': 0, 'top_p': 0.9}
        >>> Strategy(temperature=0.7, top_p=0.9).label
        'sample(temperature=0.7, top_p=0.9)'
        >>> Strategy(num_beams=4, length_normalization="gnmt", length_alpha=0.6).label
        'beam(num_beams=4, length_normalization=gnmt, length_alpha=0.6)'
    """

    __slots__ = ("_do_sample", "_name", "_values")

    def __init__(self, name: str | None = None, do_sample: bool | None = None, **fields: Any) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a string or None; got {name!r}")
        unknown = sorted(set(fields) - set(BY_NAME))
        if unknown:
            raise TypeError(f"unknown Strategy field(s): {', '.join(unknown)}; known: {', '.join(sorted(BY_NAME))}")
        if do_sample is not None:
            if not is_bool(do_sample):
                raise TypeError(f"do_sample must be True, False or None; got {do_sample!r}")
            do_sample = bool(do_sample)
        values: dict[str, Any] = {}
        for field in FIELDS:  # table order, so that equal recipes hold equal dicts
            value = fields.get(field.name)
            if value is None:
                continue
            values[field.name] = _canonical_stages(value) if field.name == "staged_penalty" else field.check(value)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_do_sample", do_sample)
        object.__setattr__(self, "_values", values)
        self._check_combinations()

    def _check_combinations(self) -> None:
        values = self._values
        for name in values:
            requires = BY_NAME[name].requires
            if requires and requires not in values:
                raise ValueError(f"{name} applies to {requires}: set {requires} too")
        if self.beam and (self._do_sample or self._sampling_fields()):
            named = (["do_sample"] if self._do_sample else []) + self._sampling_fields()
            raise ValueError(f"num_beams selects beam search, which does not sample: drop {', '.join(named)}")
        sizes = [name for name in CACHE_SIZES if name in values]
        if len(sizes) > 1:
            if sizes == ["kv_budget", "kv_compression_ratio"]:
                check_cache_size(
                    values["kv_budget"], values["kv_compression_ratio"], names=("kv_budget", "kv_compression_ratio")
                )
            raise ValueError(f"give one cache size, not {' and '.join(sizes)}")
        options = [name for name in CACHE_OPTIONS if name in values]
        if options and not sizes:
            raise ValueError(
                f"{options[0]} applies to a compressed cache: "
                "set kv_budget, kv_compression_ratio or kv_memory_fraction too"
            )
        for name in ("kv_replay", "kv_matched_layers"):
            if name in values and values.get("kv_scoring") != "reconstruction":
                raise ValueError(f"{name} applies to kv_scoring=reconstruction: set kv_scoring to reconstruction")
        # A size in bytes with no width stores coded widths (``byte_sized_widths``).
        bits = values.get("kv_bits")
        quantized = bits in CODED_BITS or (bits is None and "kv_memory_fraction" in values)
        if "kv_residual_length" in values and not quantized:
            raise ValueError(
                "kv_residual_length applies to keys and values stored in 8, 5, 4, 3 or 2 bits: set kv_bits to one of "
                "them, or size the cache with kv_memory_fraction"
            )
        if self._do_sample is False and self._sampling_fields():
            names = ", ".join(self._sampling_fields())
            raise ValueError(f"{names} only apply when sampling: leave do_sample unset or set it to True")

    def __getattr__(self, item: str) -> Any:
        if item in BY_NAME:
            return self._values.get(item)
        raise AttributeError(f"'Strategy' has no attribute {item!r}")

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("a Strategy is immutable: build a new one (Strategy.from_dict({**s.to_dict(), ...}))")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Strategy) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple:
        return (self._name, self._do_sample, tuple(self._values.items()))

    def __repr__(self) -> str:
        return f"Strategy({', '.join(f'{key}={value!r}' for key, value in self.to_dict().items())})"

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def do_sample(self) -> bool | None:
        return self._do_sample

    def _sampling_fields(self) -> list[str]:
        return [name for name in SAMPLING_FIELDS if name in self._values]

    @property
    def sampling(self) -> bool:
        """Whether this recipe samples (True) or decodes greedily (False)."""
        return self._do_sample if self._do_sample is not None else bool(self._sampling_fields())

    @property
    def beam(self) -> bool:
        """Whether this recipe is a beam search."""
        return "num_beams" in self._values

    @property
    def compresses_cache(self) -> bool:
        """Whether this recipe decodes with a ``CompressedCache`` (a fresh one per generate call)."""
        return any(name in self._values for name in (*CACHE_SIZES, "kv_bits"))

    @property
    def label(self) -> str:
        """A short human-readable name: ``name`` if given, else one built from the fields."""
        if self._name:
            return self._name

        def shown(value: Any) -> str:
            return f"[{', '.join(map(repr, value))}]" if isinstance(value, tuple) else str(value)

        others = [f"{key}={shown(value)}" for key, value in self._values.items()
                  if BY_NAME[key].family in ("penalty", "cache")]  # fmt: skip
        if self.beam:
            parts = [f"{key}={shown(value)}" for key, value in self._values.items() if BY_NAME[key].family == "beam"]
            return f"beam({', '.join(parts + others)})"
        if not self.sampling:
            return "greedy" + (f"({', '.join(others)})" if others else "")
        parts = [f"{key}={shown(self._values[key])}" for key in self._sampling_fields()]
        return f"sample({', '.join(parts + others)})"

    def plan(
        self,
        model: Any = None,
        *,
        tokenizer: Any = None,
        prompt_length: int | None = None,
        attention_mask: torch.Tensor | None = None,
        row_seeds: Sequence[int] | torch.Tensor | None = None,
    ) -> GenerationPlan:
        """The typed plan that carries out this recipe in ``model.generate``.

        ``model`` is the model the call will run on (a compressed cache is bound to it).
        ``attention_mask`` (the batch's) gives each row's left padding, which no penalty counts,
        and the prompt length, which penalties that count generated tokens only need (or give
        ``prompt_length``). ``tokenizer`` turns DRY's sequence breakers into token ids.
        ``row_seeds`` (one integer per prompt) makes sampling draw each row from its own seed, so
        a prompt samples the same text alone or in any batch (see ``GumbelSamplingLogitsProcessor``).

        Example:
            >>> plan = Strategy(temperature=0.7, min_p=0.1).plan(prompt_length=5)
            >>> plan.sampling, [type(p).__name__ for p in plan.processors], plan.streams
            ({'do_sample': True, 'temperature': 0.7, 'top_k': 0, 'top_p': 1.0}, ['MinPLogitsProcessor'], True)
        """
        if attention_mask is not None and prompt_length is None:
            prompt_length = attention_mask.shape[1]
        pad_token_id = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
        context = PlanContext(
            prompt_length=prompt_length,
            padding_lengths=None if attention_mask is None else (attention_mask != 0).int().argmax(dim=1),
            pad_token_id=pad_token_id if isinstance(pad_token_id, int) else None,
            temperature=self.temperature or 1.0,
            row_seeds=row_seeds,
            tokenizer=tokenizer,
        )
        processors = [self._build(component, context) for component in COMPONENTS if self._uses(component)]
        sampling: dict[str, Any] = {"do_sample": self.sampling}
        if self.sampling:
            sampling.update(
                temperature=float(self.temperature or 1.0), top_k=self.top_k or 0, top_p=float(self.top_p or 1.0)
            )
        decoder_kwargs: dict[str, Any] = {}
        if self.beam:
            decoder_kwargs = {"num_beams": self.num_beams, **{name: self._values[name] for name in BEAM_FIELDS
                                                               if name in self._values}}  # fmt: skip
        cache = None
        if self.compresses_cache:
            if model is None:
                raise ValueError("the kv_ fields need the model: call plan(model)")
            from decodekit.cache.compressed import CompressedCache

            cache = CompressedCache(
                model, self.kv_budget, compression_ratio=self.kv_compression_ratio,
                memory_fraction=self.kv_memory_fraction, kv_bits=self.kv_bits, scoring=self.kv_scoring or "attention",
                replay=self.kv_replay or "auto", eviction_interval=self.kv_eviction_interval,
                residual_length=self.kv_residual_length, matched_layers=self.kv_matched_layers,
            )  # fmt: skip
        plan = GenerationPlan(processors=processors, sampling=sampling, beam=self.beam,
                              decoder_kwargs=decoder_kwargs, cache=cache, prefill_chunk=self.prefill_chunk)  # fmt: skip
        return plan.with_row_seeds(row_seeds, prompt_length) if self.sampling and row_seeds is not None else plan

    def _uses(self, component: Any) -> bool:
        return any(field.name in self._values for field in component.fields)

    def _build(self, component: Any, context: PlanContext) -> Any:
        module, function = component.build.split(":")
        values = {field.name: self._values[field.name] for field in component.fields if field.name in self._values}
        return getattr(importlib.import_module(module), function)(values, context)

    def logits_processors(self, prompt_length: int | None = None, **context: Any) -> list[Any]:
        """decodekit's processors for this recipe, in the order they run (see ``plan``)."""
        return list(self.plan(prompt_length=prompt_length, **context).processors)

    def generate_kwargs(self, model: Any = None, **context: Any) -> dict[str, Any]:
        """The keyword arguments for ``model.generate``: ``plan(model, ...).generate_kwargs()``.

        Example:
            >>> kwargs = Strategy(temperature=0.7, top_p=0.9).generate_kwargs(prompt_length=5, row_seeds=[1, 2])
            >>> kwargs["do_sample"], [type(p).__name__ for p in kwargs["logits_processor"]]
            (False, ['TemperatureLogitsWarper', 'TopPLogitsWarper', 'GumbelSamplingLogitsProcessor'])
        """
        return self.plan(model, **context).generate_kwargs()

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, for reports; ``Strategy(**s.to_dict())`` rebuilds it."""
        head = {
            key: value for key, value in (("name", self._name), ("do_sample", self._do_sample)) if value is not None
        }
        return {**head, **{key: list(value) if isinstance(value, tuple) else value
                           for key, value in self._values.items()}}  # fmt: skip

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Strategy:
        """Build a Strategy from a mapping, rejecting unknown keys by name."""
        known = {"name", "do_sample", *BY_NAME}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown Strategy field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)
