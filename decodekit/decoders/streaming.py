"""Watching a beam search: an iterator over each step's best hypotheses, as text.

transformers' streamers refuse beam search (a beam's tokens can still change), so
:func:`~decodekit.decoders.beam_search` reports progress to an ``on_step`` observer instead.
:class:`BeamSearchStreamer` is one that a UI can iterate over from another thread.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any

from decodekit.decoders.beam_search import BeamSearchStep

_END = object()


@dataclass(frozen=True)
class BeamProgress:
    """One step of a beam search, per request: the best hypothesis so far as text.

    Attributes:
        step: how many tokens the running beams have generated.
        texts: the best hypothesis's new text, one per request.
        scores: their length-normalized scores.
        finished: whether each of those hypotheses has ended.
    """

    step: int
    texts: list[str]
    scores: list[float]
    finished: list[bool]


class BeamSearchStreamer:
    """Collects beam search progress for another thread to iterate over.

    Pass it as ``on_step`` and run generate in a thread; iterating yields a
    :class:`BeamProgress` per step and stops when the search ends (normally or with an error).

    Args:
        tokenizer: decodes the new tokens of each best hypothesis.
        skip_special_tokens: drop special tokens (EOS, padding) from the texts.
        timeout: seconds to wait for the next step before ``queue.Empty`` is raised; None waits.

    Example (with ``model``, ``tokenizer`` and ``batch`` from ``load_model``/``encode_prompts``)::

        from threading import Thread
        streamer = BeamSearchStreamer(tokenizer)
        kwargs = dict(**batch, custom_generate=beam_search, num_beams=4, on_step=streamer)
        Thread(target=model.generate, kwargs=kwargs).start()
        for progress in streamer:
            print(progress.step, progress.texts[0])
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True, timeout: float | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.timeout = timeout
        self._queue: queue.Queue = queue.Queue()

    def __call__(self, step: BeamSearchStep) -> None:
        new_tokens = step.sequences[:, step.prompt_length :].tolist()
        texts = self.tokenizer.batch_decode(new_tokens, skip_special_tokens=self.skip_special_tokens)
        self._queue.put(BeamProgress(step.step, texts, step.scores.tolist(), step.finished.tolist()))

    def end(self) -> None:
        """Called by the search when it stops; ends the iteration."""
        self._queue.put(_END)

    def __iter__(self) -> BeamSearchStreamer:
        return self

    def __next__(self) -> BeamProgress:
        item = self._queue.get(timeout=self.timeout)
        if item is _END:
            raise StopIteration
        return item
