"""A step-by-step trace of a generation: each step's likeliest tokens before and after the recipe's processors.

Sampling and greedy recipes are traced from what generate itself computed (its raw logits and the
scores after every processor and warper, temperature included), so the trace shows exactly what the
token was drawn from. A beam search's steps follow several hypotheses at once: its trace re-scores
the best hypothesis in one forward pass (with a full cache) and applies the recipe's processors to
each step's log-probabilities, as the search did.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from decodekit.generation import check_max_new_tokens, prepare
from decodekit.settings import DEFAULT_SYSTEM_PROMPT
from decodekit.strategies import Strategy


@dataclass(frozen=True)
class Candidate:
    """A token with its probability under the model (``before``) and after the processors (``after``)."""

    token: str
    token_id: int
    before: float
    after: float


@dataclass(frozen=True)
class TraceStep:
    """One decoding step: the ``top`` likeliest tokens under the model, and the token chosen."""

    step: int
    candidates: tuple[Candidate, ...]
    chosen: Candidate

    def line(self) -> str:
        """The step as one line: ``Step 3 candidates: ' Paris' 0.412 -> 0.655 | ... -> selected ' Paris'``."""
        shown = " | ".join(f"{c.token!r} {c.before:.3f} -> {c.after:.3f}" for c in self.candidates)
        return f"Step {self.step} candidates: {shown} -> selected {self.chosen.token!r}"


@dataclass(frozen=True)
class Trace:
    """A traced generation: its text and its steps."""

    text: str
    steps: tuple[TraceStep, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "steps": [asdict(step) for step in self.steps]}


def generate_with_trace(
    model: Any,
    tokenizer: Any,
    prompt: str,
    strategy: Strategy | None = None,
    *,
    top: int = 5,
    max_new_tokens: int = 128,
    chat: bool | None = None,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    **generate_kwargs: Any,
) -> Trace:
    """Generate from ``prompt`` with ``strategy`` and trace every step (the text is what generate gives alone).

    Example (with ``model`` and ``tokenizer`` from ``load_model``)::

        trace = generate_with_trace(model, tokenizer, "The capital of France is", Strategy(min_p=0.1), top=3)
        for step in trace.steps:
            print(step.line())
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top (the candidates shown per step) must be an integer >= 1; got {top!r}")
    check_max_new_tokens(max_new_tokens)
    strategy = strategy or Strategy()
    batch, plan = prepare(model, tokenizer, [prompt], strategy, chat=chat, system_prompt=system_prompt)
    kwargs = {**plan.generate_kwargs(), **generate_kwargs}
    if not strategy.beam:
        kwargs.update(output_logits=True, output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        output = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **kwargs)
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    prompt_length = batch["input_ids"].shape[1]
    new_ids = sequences[0, prompt_length:].tolist()
    if strategy.beam:
        if tokenizer.pad_token_id in new_ids:  # a finished hypothesis is padded to the batch's length
            new_ids = new_ids[: new_ids.index(tokenizer.pad_token_id) + 1]
        raw, processed = _rescored(model, sequences[:1, : prompt_length + len(new_ids)], prompt_length, plan)
    else:
        raw = torch.stack([logits[0] for logits in output.logits])
        processed = torch.stack([scores[0] for scores in output.scores])
    steps = tuple(
        _step(tokenizer, index + 1, raw[index], processed[index], token, top) for index, token in enumerate(new_ids)
    )
    return Trace(tokenizer.decode(new_ids, skip_special_tokens=True), steps)


def _rescored(model: Any, sequence: torch.Tensor, prompt_length: int, plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Each new token's logits given the hypothesis before it, and the log-probabilities the recipe's
    processors make of them (as beam search hands them log-probabilities)."""
    with torch.inference_mode():
        logits = model(sequence).logits[0, prompt_length - 1 : -1].float()
        processed = []
        for index in range(logits.shape[0]):
            scores = torch.log_softmax(logits[index : index + 1], dim=-1)
            for processor in plan.processors:
                scores = processor(sequence[:, : prompt_length + index], scores)
            processed.append(scores[0])
    return logits, torch.stack(processed) if processed else logits


def rank_candidates(
    tokenizer: Any, raw: torch.Tensor, processed: torch.Tensor, top: int, chosen: int = -1
) -> tuple[tuple[Candidate, ...], Candidate | None]:
    """One step's ``top`` likeliest tokens under the model (``raw`` logits), with their probabilities before
    and after the processors (``processed`` scores), and the ``chosen`` token's (None when not given)."""
    before = torch.softmax(raw.float(), dim=-1)
    after = torch.softmax(processed.float(), dim=-1)

    def candidate(index: int) -> Candidate:
        return Candidate(tokenizer.decode([index]), index, float(before[index]), float(after[index]))

    shown = before.topk(min(top, before.shape[-1])).indices.tolist()
    return tuple(candidate(index) for index in shown), (candidate(chosen) if chosen >= 0 else None)


def _step(tokenizer: Any, number: int, raw: torch.Tensor, processed: torch.Tensor, token: int, top: int) -> TraceStep:
    shown, chosen = rank_candidates(tokenizer, raw, processed, top, token)
    return TraceStep(number, shown, chosen)
