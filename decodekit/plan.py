"""A Strategy's plan for ``model.generate``: typed parts that callers read, not a dict they reopen."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from decodekit.logits_processors import GumbelSamplingLogitsProcessor


@dataclass(frozen=True)
class PlanContext:
    """What the processors of one generate call need to know about it.

    Attributes:
        prompt_length: the padded prompt's length (``input_ids.shape[1]``), or None if unknown.
        padding_lengths: each row's left padding, ``[rows]``, or None (then ``pad_token_id`` marks it).
        pad_token_id: the model's pad token id, or None.
        temperature: the temperature the recipe samples at (1.0 when it does not sample).
        row_seeds: one seed per prompt, or None.
        tokenizer: the model's tokenizer, or None.
    """

    prompt_length: int | None = None
    padding_lengths: torch.Tensor | None = None
    pad_token_id: int | None = None
    temperature: float = 1.0
    row_seeds: Sequence[int] | torch.Tensor | None = None
    tokenizer: Any = None

    def require_prompt_length(self, who: str) -> int:
        """The prompt length, or a ValueError saying that ``who`` needs it."""
        if self.prompt_length is None:
            raise ValueError(
                f"{who} count generated tokens only: pass prompt_length (the padded prompt's input_ids.shape[1]) "
                "or attention_mask"
            )
        return self.prompt_length

    def require_tokenizer(self, who: str) -> Any:
        """The tokenizer, or a ValueError saying that ``who`` needs it."""
        if self.tokenizer is None:
            raise ValueError(f"{who} needs the tokenizer: pass tokenizer=... to Strategy.plan or generate_kwargs")
        return self.tokenizer


@dataclass(frozen=True)
class GenerationPlan:
    """The parts of one generate call.

    Attributes:
        processors: decodekit's logits processors, in the order they run.
        sampling: generate's sampling arguments (``do_sample``, and when sampling ``temperature``,
            ``top_k``, ``top_p``).
        beam: whether decodekit's beam search decodes (then ``decoder_kwargs`` are its settings).
        decoder_kwargs: ``num_beams`` and the length normalization, for beam search.
        cache: a fresh ``CompressedCache`` for this call, or None for generate's own cache.
        prefill_chunk: tokens per forward pass over the prompt (generate's ``prefill_chunk_size``), or None for one
            pass.

    Example:
        >>> from decodekit import Strategy
        >>> plan = Strategy(num_beams=4).plan()
        >>> plan.beam, plan.streams, plan.decoder_kwargs
        (True, False, {'num_beams': 4})
    """

    processors: list[Any] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=lambda: {"do_sample": False})
    beam: bool = False
    decoder_kwargs: dict[str, Any] = field(default_factory=dict)
    cache: Any = None
    prefill_chunk: int | None = None

    @property
    def streams(self) -> bool:
        """Whether tokens can be shown as they come (a beam's text can still change)."""
        return not self.beam

    def with_row_seeds(self, row_seeds: Sequence[int] | torch.Tensor, prompt_length: int | None) -> GenerationPlan:
        """Sampling moved into processors ending in seeded Gumbel noise, so each row draws from its seed."""
        if prompt_length is None:
            raise ValueError("row_seeds needs the prompt length: pass attention_mask (or prompt_length)")
        temperature, top_k, top_p = (self.sampling[key] for key in ("temperature", "top_k", "top_p"))
        warpers: list[Any] = []
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p))
        sampler = GumbelSamplingLogitsProcessor(row_seeds, prompt_length=prompt_length)
        return replace(self, processors=[*self.processors, *warpers, sampler], sampling={"do_sample": False})

    def generate_kwargs(self, extra_processors: Sequence[Any] = ()) -> dict[str, Any]:
        """The keyword arguments for ``model.generate``; ``extra_processors`` run after the plan's."""
        from decodekit.decoders import beam_search

        kwargs: dict[str, Any] = {}
        if self.beam:
            kwargs.update(custom_generate=beam_search, **self.decoder_kwargs)
        kwargs.update(self.sampling)
        processors = [*self.processors, *extra_processors]
        if processors:
            kwargs["logits_processor"] = LogitsProcessorList(processors)
        if self.cache is not None:
            kwargs["past_key_values"] = self.cache
        if self.prefill_chunk is not None:
            kwargs["prefill_chunk_size"] = self.prefill_chunk
        return kwargs
