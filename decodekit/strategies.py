"""Strategy: one named decoding recipe, turned into the keyword arguments of ``model.generate``.

The CLI, the demo and the evaluation runner all build their generate calls from a Strategy, so
each recipe is written once. A Strategy states the whole recipe: a filter it does not name is
off, whatever defaults the model's ``generation_config`` carries (transformers would otherwise
apply top-k 50 to every sampling call).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from decodekit._validation import check_int, check_real, is_bool
from decodekit.cache.compressed import CompressedCache
from decodekit.cache.layer import check_cache_size
from decodekit.decoders import beam_search
from decodekit.logits_processors import (
    FrequencyPresencePenaltyLogitsProcessor,
    GumbelSamplingLogitsProcessor,
    MinPLogitsProcessor,
    StagedRepetitionPenaltyLogitsProcessor,
    parse_stages,
)
from decodekit.logits_processors.repetition import check_stage_table
from decodekit.settings import INTEGER_FIELDS, NORMALIZATIONS, REAL_FIELDS

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")
BEAM_FIELDS = ("length_normalization", "length_alpha", "length_reward", "early_stopping")


def _canonical_stages(stages: str | Mapping[int, float]) -> str:
    """One text form for a stage table, so equal tables compare and hash equal."""
    table = check_stage_table(parse_stages(stages) if isinstance(stages, str) else stages, "staged_penalty")
    return ",".join(f"{count}:{penalty:g}" for count, penalty in table)


@dataclass(frozen=True)
class Strategy:
    """A decoding recipe: greedy or sampling, with filters and repetition penalties.

    Args:
        name: a label for reports and the demo; derived from the fields when omitted.
        do_sample: sample instead of taking the most likely token. None (the default) means
            "sample when any sampling field is set".
        temperature: divides the logits before sampling; in [1e-6, 1e4].
        top_k: keep only the k most likely tokens; >= 1.
        top_p: keep the smallest set of tokens whose probability reaches p; in (0, 1].
        min_p: keep the tokens at least min_p times as likely as the top one, judged at the
            sampling temperature (``MinPLogitsProcessor``); in [0, 1].
        staged_penalty: a stage table ``{count: penalty}`` or ``"1:1.2,3:1.5,6:2.0"``
            (``StagedRepetitionPenaltyLogitsProcessor``); stored in that text form.
        penalty_window: how many recent tokens the staged penalty counts; None for all.
        frequency_penalty: OpenAI-style, per occurrence in the generated text; in [-2, 2].
        presence_penalty: OpenAI-style, once a token has been generated; in [-2, 2].
        num_beams: search with this many beams (decodekit's length-normalized beam search);
            in [1, 256]. Beam search does not sample.
        length_normalization: how beam search scores finished hypotheses: "none", "average"
            (the default) or "gnmt" (see ``decodekit.decoders.LengthNormalization``).
        length_alpha: the exponent of the length normalization, in [0, 5] (default 1.0).
        length_reward: a reward per generated token added to beam scores, in [0, 10].
        early_stopping: when beam search stops: True, False (the default heuristic) or "never".
        kv_budget: decode with a ``CompressedCache`` that keeps this many tokens per layer and
            KV head (>= 36 with its default sinks and recent window).
        kv_compression_ratio: decode with a ``CompressedCache`` that evicts this fraction of the
            tokens seen, in [0, 1).

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

    name: str | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    staged_penalty: str | None = None
    penalty_window: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    num_beams: int | None = None
    length_normalization: str | None = None
    length_alpha: float | None = None
    length_reward: float | None = None
    early_stopping: bool | str | None = None
    kv_budget: int | None = None
    kv_compression_ratio: float | None = None

    def __post_init__(self) -> None:
        if self.name is not None and not isinstance(self.name, str):
            raise TypeError(f"name must be a string or None; got {self.name!r}")
        for flag in ("do_sample", "early_stopping"):  # numpy's bool counts as a bool
            if is_bool(getattr(self, flag)):
                object.__setattr__(self, flag, bool(getattr(self, flag)))
        if self.do_sample is not None and not isinstance(self.do_sample, bool):
            raise TypeError(f"do_sample must be True, False or None; got {self.do_sample!r}")
        for name, (low, high, low_open) in REAL_FIELDS.items():
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_real(name, getattr(self, name), low, high, low_open=low_open))
        for name, (minimum, maximum) in INTEGER_FIELDS.items():
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_int(name, getattr(self, name), minimum, maximum=maximum))
        if self.staged_penalty is not None:
            object.__setattr__(self, "staged_penalty", _canonical_stages(self.staged_penalty))
        if self.penalty_window is not None and self.staged_penalty is None:
            raise ValueError("penalty_window applies to staged_penalty: set staged_penalty too")
        self._check_beam_fields()
        if self.kv_budget is not None or self.kv_compression_ratio is not None:
            budget, ratio = check_cache_size(
                self.kv_budget, self.kv_compression_ratio, names=("kv_budget", "kv_compression_ratio")
            )
            object.__setattr__(self, "kv_budget", budget)
            object.__setattr__(self, "kv_compression_ratio", ratio)
        if self.do_sample is False and self._sampling_fields():
            names = ", ".join(self._sampling_fields())
            raise ValueError(f"{names} only apply when sampling: leave do_sample unset or set it to True")

    def _check_beam_fields(self) -> None:
        if self.num_beams is None:
            named = [name for name in BEAM_FIELDS if getattr(self, name) is not None]
            if named:
                raise ValueError(f"{', '.join(named)}: beam search settings, set num_beams too")
            return
        if self.do_sample or self._sampling_fields():
            named = (["do_sample"] if self.do_sample else []) + self._sampling_fields()
            raise ValueError(f"num_beams selects beam search, which does not sample: drop {', '.join(named)}")
        if self.length_normalization is not None and self.length_normalization not in NORMALIZATIONS:
            raise ValueError(
                f"length_normalization must be one of {', '.join(NORMALIZATIONS)}; got {self.length_normalization!r}"
            )
        if self.early_stopping is not None and not (
            isinstance(self.early_stopping, bool) or self.early_stopping == "never"
        ):
            raise ValueError(f"early_stopping must be True, False or 'never'; got {self.early_stopping!r}")

    def _sampling_fields(self) -> list[str]:
        return [name for name in SAMPLING_FIELDS if getattr(self, name) is not None]

    @property
    def sampling(self) -> bool:
        """Whether this recipe samples (True) or decodes greedily (False)."""
        return self.do_sample if self.do_sample is not None else bool(self._sampling_fields())

    @property
    def beam(self) -> bool:
        """Whether this recipe is a beam search."""
        return self.num_beams is not None

    @property
    def label(self) -> str:
        """A short human-readable name: ``name`` if given, else one built from the fields."""
        if self.name:
            return self.name
        penalties = [
            f"{field}={getattr(self, field)}"
            for field in (
                "staged_penalty",
                "penalty_window",
                "frequency_penalty",
                "presence_penalty",
                "kv_budget",
                "kv_compression_ratio",
            )
            if getattr(self, field) is not None
        ]
        if self.beam:
            fields_set = [field for field in ("num_beams", *BEAM_FIELDS) if getattr(self, field) is not None]
            parts = [f"{field}={getattr(self, field)}" for field in fields_set]
            return f"beam({', '.join(parts + penalties)})"
        if not self.sampling:
            return "greedy" + (f"({', '.join(penalties)})" if penalties else "")
        parts = [f"{field}={getattr(self, field)}" for field in self._sampling_fields()]
        return f"sample({', '.join(parts + penalties)})"

    @property
    def needs_prompt_length(self) -> bool:
        """Whether ``generate_kwargs`` needs the prompt length (to count generated tokens only)."""
        return self.frequency_penalty is not None or self.presence_penalty is not None

    def logits_processors(
        self,
        prompt_length: int | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        pad_token_id: int | None = None,
    ) -> LogitsProcessorList:
        """decodekit's processors for this recipe, penalties first, then min-p.

        generate runs them after its own penalties and before its temperature, top-k and top-p.
        ``attention_mask`` (the batch's) tells the staged penalty each row's left padding, which
        never counts; without it, a leading run of ``pad_token_id`` is taken as padding.
        """
        processors = LogitsProcessorList()
        if attention_mask is not None and prompt_length is None:
            prompt_length = attention_mask.shape[1]
        if self.staged_penalty is not None:
            padding = None if attention_mask is None else (attention_mask != 0).int().argmax(dim=1)
            processors.append(
                StagedRepetitionPenaltyLogitsProcessor(
                    self.staged_penalty, window=self.penalty_window, pad_token_id=pad_token_id, padding_lengths=padding
                )
            )
        if self.needs_prompt_length:
            if prompt_length is None:
                raise ValueError(
                    "frequency_penalty and presence_penalty count generated tokens only: "
                    "pass prompt_length (the padded prompt's input_ids.shape[1])"
                )
            processors.append(
                FrequencyPresencePenaltyLogitsProcessor(
                    self.frequency_penalty or 0.0, self.presence_penalty or 0.0, prompt_length=prompt_length
                )
            )
        if self.min_p is not None:
            processors.append(MinPLogitsProcessor(self.min_p, temperature=self.temperature or 1.0))
        return processors

    def generate_kwargs(
        self,
        model: Any = None,
        *,
        prompt_length: int | None = None,
        attention_mask: torch.Tensor | None = None,
        row_seeds: Sequence[int] | torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """The keyword arguments for ``model.generate`` that carry out this recipe.

        ``model`` is the model the call will run on; recipes that build per-call objects bound
        to a model (a compressed cache) need it. ``attention_mask`` is the batch's: it gives each
        row's left padding, which no penalty counts, and the prompt length, which recipes that
        count generated tokens only need (or give ``prompt_length``, the padded prompt's
        ``input_ids.shape[1]``). Without a mask, the model's pad token marks padding.

        ``row_seeds`` (one integer per prompt) makes a sampling recipe draw each row from its own
        seed, so a prompt samples the same text alone or in any batch: the filters and the
        temperature then run as processors, ``GumbelSamplingLogitsProcessor`` adds seeded noise,
        and generate decodes greedily. Greedy and beam recipes ignore it.

        Example:
            >>> kwargs = Strategy(temperature=0.7, top_p=0.9).generate_kwargs(prompt_length=5, row_seeds=[1, 2])
            >>> kwargs["do_sample"], [type(p).__name__ for p in kwargs["logits_processor"]]
            (False, ['TemperatureLogitsWarper', 'TopPLogitsWarper', 'GumbelSamplingLogitsProcessor'])
        """
        kwargs: dict[str, Any] = {"do_sample": self.sampling}
        if self.beam:
            kwargs.update(custom_generate=beam_search, num_beams=self.num_beams)
            kwargs.update({name: getattr(self, name) for name in BEAM_FIELDS if getattr(self, name) is not None})
        if self.sampling:
            kwargs["temperature"] = float(self.temperature if self.temperature is not None else 1.0)
            kwargs["top_k"] = self.top_k if self.top_k is not None else 0
            kwargs["top_p"] = float(self.top_p if self.top_p is not None else 1.0)
        pad_token_id = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
        if not isinstance(pad_token_id, int):
            pad_token_id = None
        processors = self.logits_processors(prompt_length, attention_mask=attention_mask, pad_token_id=pad_token_id)
        if self.sampling and row_seeds is not None:
            processors.extend(self._seeded_sampling(kwargs, row_seeds, prompt_length, attention_mask))
        if processors:
            kwargs["logits_processor"] = processors
        if self.compresses_cache:
            if model is None:
                raise ValueError("kv_budget and kv_compression_ratio need the model: call generate_kwargs(model)")
            kwargs["past_key_values"] = CompressedCache(
                model, self.kv_budget, compression_ratio=self.kv_compression_ratio
            )
        return kwargs

    @staticmethod
    def _seeded_sampling(
        kwargs: dict[str, Any],
        row_seeds: Sequence[int] | torch.Tensor,
        prompt_length: int | None,
        attention_mask: torch.Tensor | None,
    ) -> list[Any]:
        """Move the sampling settings out of ``kwargs`` into processors ending in seeded Gumbel noise."""
        if prompt_length is None and attention_mask is None:
            raise ValueError("row_seeds needs the prompt length: pass attention_mask (or prompt_length)")
        prompt_length = prompt_length if prompt_length is not None else attention_mask.shape[1]
        temperature, top_k, top_p = kwargs.pop("temperature"), kwargs.pop("top_k"), kwargs.pop("top_p")
        kwargs["do_sample"] = False
        warpers: list[Any] = []
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p))
        return [*warpers, GumbelSamplingLogitsProcessor(row_seeds, prompt_length=prompt_length)]

    @property
    def compresses_cache(self) -> bool:
        """Whether this recipe decodes with a ``CompressedCache`` (a fresh one per generate call)."""
        return self.kv_budget is not None or self.kv_compression_ratio is not None

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, for reports; ``Strategy(**s.to_dict())`` rebuilds it."""
        return {key: value for key, value in asdict(self).items() if value is not None}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Strategy:
        """Build a Strategy from a mapping, rejecting unknown keys by name."""
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown Strategy field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)
