"""One generation for the demo, streamed: tokens with their probabilities, live stats, a stop switch.

UI-free, so it can be tested on its own. Greedy and sampling stream token by token; beam search
reports its best hypothesis after every step (a beam's text can still change) and shades the
final tokens with their probabilities under the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from decodekit.cache import CompressedCache
from decodekit.decoders import BeamSearchStreamer
from decodekit.generation import encode_prompts
from decodekit.strategies import Strategy

TOP_CANDIDATES = 8
GENERATION_THREAD = "decodekit-generate"


@dataclass
class Update:
    """The state of a generation so far."""

    tokens: list[tuple[str, float]] = field(default_factory=list)  # (text, probability) per new token
    text: str = ""
    done: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    candidates: list[dict[str, Any]] = field(default_factory=list)  # per step: top tokens before/after


class _Recorder(LogitsProcessor):
    """Keeps each step's distribution after decodekit's processors (before temperature and top-p)."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        self.steps.append(torch.softmax(scores[0].float(), dim=-1))
        return scores


class _Stop(StoppingCriteria):
    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _TokenQueue(BaseStreamer):
    """Receives the new token ids of each step (generate's streamer protocol)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.first_at: float | None = None
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.ids.extend(value.flatten().tolist())
        self.first_at = self.first_at or time.perf_counter()

    def end(self):
        pass


def full_cache_bytes(model: Any, tokens: int, rows: int = 1) -> int:
    """The bytes a full KV cache of ``tokens`` tokens holds for this model."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * tokens * rows * element


def _candidates(tokenizer, raw: torch.Tensor, processed: torch.Tensor) -> dict[str, Any]:
    before = torch.softmax(raw.float(), dim=-1)
    after = torch.softmax(processed.float(), dim=-1)
    top = before.topk(TOP_CANDIDATES).indices.tolist()
    return {
        "tokens": [tokenizer.decode([index]) for index in top],
        "before": [float(before[index]) for index in top],
        "after": [float(after[index]) for index in top],
    }


def stream(
    model: Any,
    tokenizer: Any,
    prompt: str,
    strategy: Strategy,
    *,
    max_new_tokens: int,
    stop: threading.Event | None = None,
    interval: float = 0.05,
) -> Iterator[Update]:
    """Run one generation in a thread and yield an :class:`Update` every ``interval`` seconds."""
    stop = stop or threading.Event()
    batch = {key: value.to(model.device) for key, value in encode_prompts(tokenizer, [prompt]).items()}
    prompt_length = batch["input_ids"].shape[1]
    kwargs = strategy.generate_kwargs(model, attention_mask=batch["attention_mask"])
    recorder, tokens = _Recorder(), _TokenQueue()
    kwargs["logits_processor"] = LogitsProcessorList([*kwargs.get("logits_processor", []), recorder])
    beam_progress = BeamSearchStreamer(tokenizer) if strategy.beam else None
    if beam_progress is not None:
        kwargs["on_step"] = beam_progress
    else:
        kwargs["streamer"] = tokens
    result: dict[str, Any] = {}
    started = time.perf_counter()

    def run() -> None:
        try:
            result["output"] = model.generate(
                **batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                stopping_criteria=StoppingCriteriaList([_Stop(stop)]), return_dict_in_generate=True,
                output_scores=True, output_logits=True, **kwargs,
            )  # fmt: skip
        except Exception as error:  # reported to the page by the caller
            result["error"] = error
            if beam_progress is not None:
                beam_progress.end()

    worker = threading.Thread(target=run, name=GENERATION_THREAD, daemon=True)
    worker.start()
    if beam_progress is not None:
        for progress in beam_progress:
            yield Update(
                text=progress.texts[0], stats={"step": progress.step, "best score": round(progress.scores[0], 4)}
            )
    else:
        while worker.is_alive():
            worker.join(interval)
            shaded = _shade(tokenizer, list(tokens.ids), recorder.steps)
            stats = _stats(model, kwargs, started, tokens.first_at, len(shaded), prompt_length)
            yield Update(tokens=shaded, text="".join(text for text, _ in shaded), stats=stats)
    worker.join()
    if "error" in result:
        raise result["error"]
    yield _final(model, tokenizer, batch, kwargs, result["output"], started, tokens.first_at, strategy, recorder)


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's share of the decoded text, so that the pieces join into exactly that text
    (a token holding part of a multi-byte character gets "" and the next one the character)."""
    texts, previous = [], ""
    for end in range(1, len(ids) + 1):
        decoded = tokenizer.decode(ids[:end], skip_special_tokens=True)
        if decoded.endswith("\ufffd") and end < len(ids):  # an incomplete character: wait for its other bytes
            texts.append("")
            continue
        texts.append(decoded[len(previous) :])
        previous = decoded
    return texts


def _shade(tokenizer, ids: list[int], steps: list[torch.Tensor]) -> list[tuple[str, float]]:
    return [
        (text, float(steps[index][token]) if index < len(steps) else 0.0)
        for index, (token, text) in enumerate(zip(ids, token_texts(tokenizer, ids), strict=True))
    ]


def _stats(model, kwargs, started, first_at, generated, prompt_length) -> dict[str, Any]:
    now = time.perf_counter()
    stats: dict[str, Any] = {"new tokens": generated}
    if first_at is not None:
        stats["time to first token (s)"] = round(first_at - started, 3)
        if generated > 1 and now > first_at:
            stats["tokens/s"] = round((generated - 1) / (now - first_at), 2)
    cache = kwargs.get("past_key_values")
    stats["full KV cache (KiB)"] = round(full_cache_bytes(model, prompt_length + generated) / 1024, 1)
    if isinstance(cache, CompressedCache):
        stats["compressed KV cache (KiB)"] = round(cache.memory_bytes() / 1024, 1)
    return stats


def _final(model, tokenizer, batch, kwargs, output, started, first_at, strategy, recorder) -> Update:
    prompt_length = batch["input_ids"].shape[1]
    new_ids = output.sequences[0, prompt_length:].tolist()
    if tokenizer.pad_token_id in new_ids and strategy.beam:
        new_ids = new_ids[: new_ids.index(tokenizer.pad_token_id) + 1]
    update = Update(done=True)
    if strategy.beam:  # a beam's steps do not follow one hypothesis: score the result under the model
        with torch.inference_mode():
            logits = model(output.sequences[:1, : prompt_length + len(new_ids)]).logits[0, prompt_length - 1 : -1]
        probabilities = torch.softmax(logits.float(), dim=-1)
        texts = token_texts(tokenizer, new_ids)
        update.tokens = [(texts[i], float(probabilities[i, t])) for i, t in enumerate(new_ids)]
    else:
        update.tokens = _shade(tokenizer, new_ids, recorder.steps)
    update.text = tokenizer.decode(new_ids, skip_special_tokens=True)
    first = first_at if first_at is not None else time.perf_counter()
    update.stats = _stats(model, kwargs, started, first, len(new_ids), prompt_length)
    update.stats["total time (s)"] = round(time.perf_counter() - started, 3)
    if not strategy.beam:
        update.candidates = [
            _candidates(tokenizer, raw[0], processed[0])
            for raw, processed in zip(output.logits, output.scores, strict=False)
        ]
    return update
