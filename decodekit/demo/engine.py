"""One generation for the demo, streamed: tokens with their probabilities, live stats, a stop switch.

UI-free, so it can be tested on its own. Greedy and sampling stream token by token; beam search
reports its best hypothesis after every step (a beam's text can still change) and shades the
final tokens with their probabilities under the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import LogitsProcessor, StoppingCriteria, StoppingCriteriaList

from decodekit.cache import CompressedCache, full_cache_bytes
from decodekit.decoders import BeamSearchStreamer
from decodekit.generation import encode_prompts
from decodekit.strategies import Strategy
from decodekit.trace import rank_candidates

TOP_CANDIDATES = 8
GENERATION_THREAD = "decodekit-generate"


@dataclass(frozen=True)
class Stats:
    """A generation's numbers, in plain units (the app formats them for the page).

    Attributes:
        new_tokens: tokens generated (a beam search's final hypothesis length at the end).
        steps: decoding steps completed (one token each; a beam search step otherwise).
        first_token_seconds: from the start to the first step's end, or None before it.
        tokens_per_second: steps after the first over the time since it, or None.
        full_cache_bytes: what a full KV cache of the prompt and the steps holds.
        compressed_cache_bytes: what the compressed cache holds, or None without one.
        total_seconds: the whole generation, at the end only.
        best_score: beam search's best normalized score so far, or None.
    """

    new_tokens: int = 0
    steps: int = 0
    first_token_seconds: float | None = None
    tokens_per_second: float | None = None
    full_cache_bytes: int = 0
    compressed_cache_bytes: int | None = None
    total_seconds: float | None = None
    best_score: float | None = None


@dataclass
class Update:
    """The state of a generation so far."""

    tokens: list[tuple[str, float]] = field(default_factory=list)  # (text, probability) per new token
    text: str = ""
    done: bool = False
    stats: Stats = field(default_factory=Stats)
    candidates: list[dict[str, Any]] = field(default_factory=list)  # per step: top tokens before/after


@dataclass(frozen=True)
class Snapshot:
    """What the generation thread has published so far; immutable, so another thread reads it whole."""

    ids: tuple[int, ...] = ()
    probabilities: tuple[float, ...] = ()  # of each new token, after decodekit's processors
    steps: int = 0  # decoding steps completed (a beam search's steps; one token each otherwise)
    first_step_at: float | None = None  # perf_counter time when the first step completed
    cache_bytes: int | None = None  # a compressed cache's size after the latest step


class _Tracker(LogitsProcessor):
    """Runs in the generation thread: records each step's distribution and new token, and publishes
    a fresh :class:`Snapshot` after each, so the UI thread never reads the cache mid-update.

    It is both the last logits processor (it sees the distribution a token is drawn from) and
    generate's streamer (it receives the token drawn).
    """

    def __init__(self, cache: Any = None) -> None:
        self.cache = cache
        self.snapshot = Snapshot()
        self._distribution: torch.Tensor | None = None
        self._prompt_seen = False

    def __call__(self, input_ids, scores):
        # After the forward pass: the cache holds this step's tokens and has evicted.
        self._distribution = torch.softmax(scores[0].float(), dim=-1)
        cache_bytes = self.cache.memory_bytes() if isinstance(self.cache, CompressedCache) else None
        self.snapshot = replace(self.snapshot, cache_bytes=cache_bytes)
        return scores

    def step_done(self) -> None:
        """A decoding step ended (beam search reports it through ``on_step``)."""
        first = self.snapshot.first_step_at or time.perf_counter()
        self.snapshot = replace(self.snapshot, steps=self.snapshot.steps + 1, first_step_at=first)

    def put(self, value: torch.Tensor) -> None:  # generate's streamer protocol
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        token = int(value.flatten()[0])
        probability = float(self._distribution[token]) if self._distribution is not None else 0.0
        previous = self.snapshot
        self.snapshot = replace(
            previous,
            ids=(*previous.ids, token),
            probabilities=(*previous.probabilities, probability),
            steps=previous.steps + 1,
            first_step_at=previous.first_step_at or time.perf_counter(),
        )

    def end(self) -> None:
        pass


class _BeamSteps:
    """``on_step`` for beam search: tells the tracker a step ended, then passes the step on."""

    def __init__(self, tracker: _Tracker, streamer: BeamSearchStreamer) -> None:
        self.tracker, self.streamer = tracker, streamer

    def __call__(self, step: Any) -> None:
        self.tracker.step_done()
        self.streamer(step)

    def end(self) -> None:
        self.streamer.end()


class _Stop(StoppingCriteria):
    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def _candidates(tokenizer, raw: torch.Tensor, processed: torch.Tensor) -> dict[str, Any]:
    shown, _ = rank_candidates(tokenizer, raw, processed, TOP_CANDIDATES)
    return {
        "tokens": [candidate.token for candidate in shown],
        "before": [candidate.before for candidate in shown],
        "after": [candidate.after for candidate in shown],
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
    """Run one generation in a thread and yield an :class:`Update` every ``interval`` seconds.

    Closing the iterator early (the consumer went away) stops the generation within a step.
    """
    stop = stop or threading.Event()
    batch = {key: value.to(model.device) for key, value in encode_prompts(tokenizer, [prompt]).items()}
    prompt_length = batch["input_ids"].shape[1]
    plan = strategy.plan(model, tokenizer=tokenizer, attention_mask=batch["attention_mask"])
    tracker = _Tracker(plan.cache)
    kwargs = plan.generate_kwargs(extra_processors=[tracker])
    beam_progress = None if plan.streams else BeamSearchStreamer(tokenizer)
    if beam_progress is not None:
        kwargs["on_step"] = _BeamSteps(tracker, beam_progress)
    else:
        kwargs["streamer"] = tracker
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
        finally:
            result["ended_at"] = time.perf_counter()

    worker = threading.Thread(target=run, name=GENERATION_THREAD, daemon=True)
    worker.start()
    try:
        if beam_progress is not None:
            for progress in beam_progress:
                stats = _stats(model, tracker.snapshot, started, time.perf_counter(), prompt_length)
                yield Update(text=progress.texts[0], stats=replace(stats, best_score=progress.scores[0]))
        else:
            while worker.is_alive():
                worker.join(interval)
                snapshot = tracker.snapshot
                shaded = _shade(tokenizer, snapshot)
                stats = _stats(model, snapshot, started, time.perf_counter(), prompt_length)
                yield Update(tokens=shaded, text="".join(text for text, _ in shaded), stats=stats)
        worker.join()
    finally:  # the consumer closed the iterator early: never leave the generation running
        if worker.is_alive():
            stop.set()
    if "error" in result:
        raise result["error"]
    yield _final(model, tokenizer, batch, result, tracker.snapshot, started, strategy)


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


def _shade(tokenizer: Any, snapshot: Snapshot) -> list[tuple[str, float]]:
    texts = token_texts(tokenizer, list(snapshot.ids))
    return list(zip(texts, snapshot.probabilities, strict=True))


def _stats(model: Any, snapshot: Snapshot, started: float, now: float, prompt_length: int) -> Stats:
    """Numbers a stopwatch would agree with: a step is one token (one beam search step)."""
    first = rate = None
    if snapshot.first_step_at is not None:
        first = snapshot.first_step_at - started
        if snapshot.steps > 1 and now > snapshot.first_step_at:
            rate = (snapshot.steps - 1) / (now - snapshot.first_step_at)
    return Stats(
        new_tokens=snapshot.steps, steps=snapshot.steps, first_token_seconds=first, tokens_per_second=rate,
        full_cache_bytes=full_cache_bytes(model, prompt_length + snapshot.steps),
        compressed_cache_bytes=snapshot.cache_bytes,
    )  # fmt: skip


def _final(model, tokenizer, batch, result, snapshot, started, strategy) -> Update:
    output = result["output"]
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
        update.tokens = _shade(tokenizer, snapshot)
    update.text = tokenizer.decode(new_ids, skip_special_tokens=True)
    update.stats = replace(
        _stats(model, snapshot, started, result["ended_at"], prompt_length),
        total_seconds=result["ended_at"] - started, new_tokens=len(new_ids),
    )  # fmt: skip
    if not strategy.beam:
        update.candidates = [
            _candidates(tokenizer, raw[0], processed[0])
            for raw, processed in zip(output.logits, output.scores, strict=False)
        ]
    return update
