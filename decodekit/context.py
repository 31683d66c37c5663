"""Compress a document once, ask it many questions: a compressed context, saved to a file, loaded and forked.

A :class:`Context` is a document's compressed KV cache (a ``CompressedCache``, by default query-agnostic:
``scoring="reconstruction"`` at a tenth of a full 16-bit cache's bytes), the token ids it was filled with, and how its
questions are framed. Each question is answered from a fork of the cache, so the context stays as it was for the
next question; ``save`` writes it to one file (``decodekit.cache.persist``) and ``Context.load`` reads it back,
bound to the same model, in another process or on another day. One prefill per document, not one per question.

Framing: where the tokenizer has a chat template the document opens a user turn (after the system prompt) and a
question closes it (the document, a blank line, the question, then the assistant's header); raw (``chat=False``),
the question follows the document after a blank line.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Cache, DynamicCache

from decodekit._validation import check_int
from decodekit.cache import CompressedCache, full_cache_bytes, persist
from decodekit.generation import check_max_new_tokens, uses_chat_template
from decodekit.settings import DEFAULT_SYSTEM_PROMPT
from decodekit.strategies import Strategy

SEPARATOR = "\n\n"  # between the document and a question
_MARK = "@@decodekit-user-turn@@"  # stands for a user turn's text while the chat template is split around it
METADATA_KEY = "context"  # what a context adds to a saved cache's header (``persist.read_header(path)["metadata"]``)
# What a context is compressed to by default: a tenth of a full 16-bit cache's bytes, query-agnostic.
DEFAULT_CACHE = {"memory_fraction": 0.1, "scoring": "reconstruction"}


def chat_frame(tokenizer: Any, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> tuple[str, str]:
    """The chat template's text before a user turn's content (with ``system_prompt`` when non-empty) and after it
    (with the assistant's header); ValueError where the template does not hold the turn's text as it is.

    Example (with a ``tokenizer`` from ``load_model``)::

        before, after = chat_frame(tokenizer)
        print(repr(after))  # '<|im_end|>\\n<|im_start|>assistant\\n' for SmolLM2
    """
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    text = tokenizer.apply_chat_template(
        [*system, {"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=True
    )
    if text.count(_MARK) != 1:
        raise ValueError(
            "this tokenizer's chat template does not hold a user turn's text as it is: frame the document raw "
            "(chat=False, or --raw)"
        )
    before, after = text.split(_MARK)
    return before, after


def _check_text(name: str, text: Any) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a string; got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{name} is empty: it needs some text")
    return text


def document_ids(
    tokenizer: Any, document: str, *, chat: bool | None = None, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
) -> list[int]:
    """The token ids a context holds for ``document``: the opening of a user turn of the chat template (by default
    where the tokenizer has one) and the document, or the document alone, raw (with the tokenizer's own special
    tokens, as ``encode_prompts`` sends a raw prompt).

    Example (with a ``tokenizer`` from ``load_model``)::

        ids = document_ids(tokenizer, "The pass key is 71432.")
        print(tokenizer.decode(ids))  # <|im_start|>system ... <|im_start|>user\\nThe pass key is 71432.
    """
    _check_text("document", document)
    if uses_chat_template(tokenizer, chat):
        before, _ = chat_frame(tokenizer, system_prompt)
        return tokenizer(before + document, add_special_tokens=False)["input_ids"]
    return tokenizer(document)["input_ids"]


def question_ids(tokenizer: Any, question: str, *, chat: bool) -> list[int]:
    """The token ids that follow a document's for ``question``: a blank line, the question and, with the chat
    template (``chat``), the end of the user turn and the assistant's header.

    Example (with a ``tokenizer`` from ``load_model``)::

        ids = document_ids(tokenizer, "The pass key is 71432.") + question_ids(tokenizer, "The pass key?", chat=True)
    """
    _check_text("question", question)
    after = chat_frame(tokenizer, None)[1] if chat else ""
    return tokenizer(SEPARATOR + question + after, add_special_tokens=False)["input_ids"]


def fill(
    model: Any,
    cache: CompressedCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
    chunk: int | None = None,
) -> CompressedCache:
    """Fill a fresh ``cache`` with a prompt, ``input_ids`` ``[rows, tokens]`` (left-padded where
    ``attention_mask`` says so), at the positions ``generate`` gives it, and return it.

    The prompt is read in chunks of ``chunk`` tokens, each followed by an eviction, so that the cache never holds
    more than its size and one chunk; by default ``reconstruction_chunk`` tokens, and one pass for a cache that
    replays the prompt (``scoring="reconstruction"``), which after each chunk feeds it again in pieces of
    ``reconstruction_chunk`` tokens (none where the replay of a first pass is estimated).
    ``progress(done, total)`` is called with the forward passes made so far (chunks and replay pieces), before the
    first and after each. ``cache.token_ids`` is set to the prompt's ids (``save`` records them).

    Example (with ``model`` and a tokenized document ``ids`` ``[1, tokens]``)::

        cache = fill(model, CompressedCache(model, memory_fraction=0.1, scoring="reconstruction"), ids)
        cache.save("doc.kv")
    """
    from decodekit.cache.scorers.reconstruction import estimates_replay

    if not isinstance(cache, CompressedCache):
        raise TypeError(f"cache must be a CompressedCache; got {type(cache).__name__}")
    if cache.get_seq_length():
        raise ValueError("cache already holds tokens: fill a fresh CompressedCache")
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a tensor of token ids [rows, tokens]; got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape)
        raise ValueError(f"input_ids must be [rows, tokens] with at least one token; got shape {shape}")
    rows, length = input_ids.shape
    input_ids = input_ids.to(model.device)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(model.device)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    replay_chunk = cache.options.replay.chunk
    replays = cache.layers[0].waits_for_prompt_scores
    if replays and chunk is None:
        chunk = length
    chunk = replay_chunk if chunk is None else check_int("chunk", chunk, 1)
    spans = [(start, min(start + chunk, length)) for start in range(0, length, chunk)]
    total = len(spans)
    if replays:  # each chunk's replay pieces too (none for a first chunk whose replay is estimated)
        first = spans[0][1]
        estimated = estimates_replay(cache.options, cache.policy, first, rows)
        total += sum(math.ceil((stop - start) / replay_chunk) for start, stop in spans[1 if estimated else 0 :])
    started = 0

    def count(*_: Any) -> None:  # a forward pass begins: every one before it has ended
        nonlocal started
        if progress is not None and started:
            progress(min(started, total), total)
        started += 1

    if progress is not None:
        progress(0, total)
    only_last = {"logits_to_keep": 1} if "logits_to_keep" in _parameters(model) else {}
    hook = model.register_forward_pre_hook(count)
    try:
        with torch.no_grad():
            for start, stop in spans:
                model(input_ids=input_ids[:, start:stop], attention_mask=mask[:, :stop],
                      position_ids=positions[:, start:stop], past_key_values=cache, **only_last)  # fmt: skip
    finally:
        hook.remove()
    if progress is not None:
        progress(total, total)
    ids = input_ids.tolist()
    cache.token_ids = ids[0] if rows == 1 else ids
    cache.end_context()  # (a question asked later is not part of the document)
    return cache


def _parameters(model: Any) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)


@dataclass
class Answer:
    """One question's answer from a context.

    Attributes:
        text: the answer (the new tokens, decoded without special tokens).
        token_ids: the answer's token ids.
        cache: the cache it was answered from, after the answer: the context's fork, or the full cache that read
            the document again (``full=True``).
        cache_bytes: the bytes ``cache`` holds (``memory_bytes()``, or every key and value of the full cache).
        seconds: the time from the fork (or the full cache's first pass) to the last token.
    """

    text: str
    token_ids: list[int]
    cache: Cache
    cache_bytes: int
    seconds: float


@dataclass
class Context:
    """A compressed document to ask many questions of.

    Attributes:
        cache: the document's compressed KV cache, bound to the model it was made with (never changed by a
            question: each is answered from a fork).
        token_ids: the document's token ids, as the cache was filled with them (with their framing).
        chat: whether questions close a user turn of the chat template (the document opened it) or follow it raw.

    Example (with ``model`` and ``tokenizer`` from ``load_model``)::

        context = Context.compress(model, tokenizer, open("report.txt").read())   # a tenth of the bytes
        context.save("report.kv")
        context = Context.load("report.kv", model)                                # later, in another process
        for question in ["Who wrote it?", "When?"]:
            print(context.ask(model, tokenizer, question, max_new_tokens=32))
    """

    cache: CompressedCache
    token_ids: list[int]
    chat: bool = False

    @classmethod
    def compress(
        cls,
        model: Any,
        tokenizer: Any,
        document: str,
        cache: CompressedCache | None = None,
        *,
        chat: bool | None = None,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        progress: Callable[[int, int], None] | None = None,
    ) -> Context:
        """Compress ``document`` into ``cache`` (a fresh ``CompressedCache`` bound to ``model``; default:
        ``CompressedCache(model, memory_fraction=0.1, scoring="reconstruction")``), framed by ``document_ids``;
        ``progress`` as ``fill`` calls it.

        Example (with ``model`` and ``tokenizer`` from ``load_model``)::

            context = Context.compress(model, tokenizer, text, CompressedCache(model, budget=512))
            print(context.seen, context.kept, context.memory_bytes())
        """
        chat = uses_chat_template(tokenizer, chat)
        ids = document_ids(tokenizer, document, chat=chat, system_prompt=system_prompt)
        return cls.from_ids(model, ids, cache, chat=chat, progress=progress)

    @classmethod
    def from_ids(
        cls,
        model: Any,
        token_ids: Sequence[int],
        cache: CompressedCache | None = None,
        *,
        chat: bool = False,
        progress: Callable[[int, int], None] | None = None,
        chunk: int | None = None,
    ) -> Context:
        """A context of a document already tokenized (``token_ids``, its framing included), compressed into
        ``cache`` (default as ``compress``'s), read in chunks of ``chunk`` tokens (see ``fill``).

        Example (with ``model`` and ``tokenizer`` from ``load_model``)::

            context = Context.from_ids(model, tokenizer("The pass key is 71432. " * 50)["input_ids"])
            print(context.ask(model, tokenizer, tokenizer(" The pass key is")["input_ids"], max_new_tokens=4))
        """
        token_ids = [int(token) for token in token_ids]
        if not token_ids:
            raise ValueError("token_ids is empty: a context needs a document")
        cache = CompressedCache(model, **DEFAULT_CACHE) if cache is None else cache
        fill(model, cache, torch.tensor([token_ids]), progress=progress, chunk=chunk)
        return cls(cache, token_ids, chat)

    @property
    def seen(self) -> int:
        """The document's tokens (framing included)."""
        return len(self.token_ids)

    @property
    def kept(self) -> int:
        """The most tokens the cache keeps for any layer and KV head."""
        return self.cache.kept_tokens

    def memory_bytes(self) -> int:
        """The bytes the compressed cache holds (``CompressedCache.memory_bytes``)."""
        return self.cache.memory_bytes()

    def fork(self) -> Context:
        """An independent copy: what one question changes in it leaves this context as it was.

        Example (with ``context``, ``model`` and ``question_ids``)::

            copy = context.fork()
            model(torch.tensor([copy.token_ids + question_ids]), past_key_values=copy.cache)  # context unchanged
        """
        return Context(self.cache.fork(), list(self.token_ids), self.chat)

    def save(self, path: str | os.PathLike, **notes: Any) -> Path:
        """Write the context to ``path`` (``CompressedCache.save``: atomic, checked when loaded), with how its
        questions are framed and any JSON ``notes`` (such as the document's file name).

        Example (with a ``context``)::

            context.save("report.kv", source="report.txt")
            print(read_notes("report.kv"))  # {'chat': True, 'source': 'report.txt'}
        """
        metadata = {METADATA_KEY: {"chat": self.chat, **notes}}
        return self.cache.save(path, token_ids=self.token_ids, metadata=metadata)

    @classmethod
    def load(cls, path: str | os.PathLike, model: Any, device: torch.device | str | None = None) -> Context:
        """A context read from a file ``save`` (or ``CompressedCache.save`` with the token ids of one row) wrote,
        bound to ``model``; ValueError naming what does not fit (another model or checkpoint, dtype, format
        version, a truncated or corrupted file).

        Example (with ``model`` and ``tokenizer`` from ``load_model``)::

            context = Context.load("report.kv", model)
            print(context.ask(model, tokenizer, "Who signed it?", max_new_tokens=24))
        """
        header = persist.read_header(path)
        if header.get("token_ids") is None:
            raise ValueError(
                f"{path} was saved without the token ids it holds: save it with cache.save(path, token_ids=...)"
            )
        if header["token_ids"] and isinstance(header["token_ids"][0], list):
            raise ValueError(f"{path} holds {len(header['token_ids'])} rows; a context is one document (one row)")
        notes = (header.get("metadata") or {}).get(METADATA_KEY) or {}
        cache = CompressedCache.load(path, model, device)
        return cls(cache, list(cache.token_ids), bool(notes.get("chat", False)))

    def question_ids(self, tokenizer: Any, question: str | Sequence[int]) -> list[int]:
        """The token ids that follow the document's for ``question`` (text, framed as the document was; or token
        ids, taken as they are).

        Example (with a ``context`` and a ``tokenizer``)::

            ids = context.token_ids + context.question_ids(tokenizer, "Who signed it?")  # what generate reads
        """
        if isinstance(question, str):
            return question_ids(tokenizer, question, chat=self.chat)
        ids = [int(token) for token in question]
        if not ids:
            raise ValueError("question is empty: it needs some tokens")
        return ids

    def answer(
        self,
        model: Any,
        tokenizer: Any,
        question: str | Sequence[int],
        strategy: Strategy | None = None,
        *,
        max_new_tokens: int = 128,
        full: bool = False,
        **generate_kwargs: Any,
    ) -> Answer:
        """Answer ``question`` (text, or token ids taken as they are) from a fork of the context, with ``strategy``
        (greedy by default; its own ``kv_`` fields are refused: the context brings its cache); ``full=True``
        answers as the document re-read with the full cache would instead (the baseline). Extra keyword arguments
        go to ``model.generate`` (a ``streamer``...).

        Example (with a ``context``, ``model`` and ``tokenizer``)::

            short = context.answer(model, tokenizer, "Who signed it?", max_new_tokens=24)
            full = context.answer(model, tokenizer, "Who signed it?", max_new_tokens=24, full=True)
            print(short.text, short.cache_bytes, "|", full.text, full.cache_bytes)
        """
        check_max_new_tokens(max_new_tokens)
        strategy = strategy or Strategy()
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a Strategy; got {type(strategy).__name__}")
        if strategy.compresses_cache:
            raise ValueError(
                "a context answers from its own compressed cache: drop the strategy's kv_ fields (they apply when "
                "compressing)"
            )
        ids = torch.tensor([self.token_ids + self.question_ids(tokenizer, question)], device=model.device)
        mask = torch.ones_like(ids)
        plan = strategy.plan(model, tokenizer=tokenizer, attention_mask=mask)
        kwargs = plan.generate_kwargs(extra_processors=generate_kwargs.pop("logits_processor", None) or ())
        kwargs.update(generate_kwargs)
        started = time.perf_counter()
        cache = DynamicCache(config=model.config) if full else self.cache.fork()
        if plan.beam and not full:  # generate gives each beam a row of the ids, not of a cache it receives filled
            cache.batch_repeat_interleave(strategy.num_beams)
        with torch.no_grad():
            output = model.generate(
                input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id, **kwargs,
            )  # fmt: skip
        seconds = time.perf_counter() - started
        new = output[0, ids.shape[1] :].tolist()
        return Answer(tokenizer.decode(new, skip_special_tokens=True), new, cache, held_bytes(cache), seconds)

    def ask(
        self,
        model: Any,
        tokenizer: Any,
        question: str | Sequence[int],
        strategy: Strategy | None = None,
        *,
        max_new_tokens: int = 128,
        **generate_kwargs: Any,
    ) -> str:
        """The text of ``answer(...)``: ``question`` answered from a fork of the context.

        Example (with a ``context``, ``model`` and ``tokenizer``)::

            for question in ["Who signed it?", "When?"]:
                print(context.ask(model, tokenizer, question, Strategy(num_beams=4), max_new_tokens=24))
        """
        return self.answer(model, tokenizer, question, strategy, max_new_tokens=max_new_tokens, **generate_kwargs).text

    def summary(self, model: Any) -> dict[str, int]:
        """The context's numbers: tokens seen and kept, bytes held, and the bytes a full 16-bit cache of the same
        tokens holds.

        Example (with a ``context`` and its ``model``)::

            numbers = context.summary(model)
            print(numbers["memory_bytes"] / numbers["full_16bit_bytes"])  # about 0.1 by default
        """
        return {
            "tokens_seen": self.seen, "tokens_kept": self.kept, "memory_bytes": self.memory_bytes(),
            "full_16bit_bytes": full_cache_bytes(model, self.seen, element_size=2),
        }  # fmt: skip


def held_bytes(cache: Cache) -> int:
    """The bytes ``cache`` holds: ``memory_bytes()`` of a compressed cache, else every key and value tensor of its
    layers (a ``DynamicCache``).

    Example:
        >>> cache = DynamicCache()
        >>> _ = cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 0)
        >>> held_bytes(cache)  # keys and values: 2 * 1 * 2 * 5 * 4 float32 values
        320
    """
    if isinstance(cache, CompressedCache):
        return cache.memory_bytes()
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def read_notes(path: str | os.PathLike) -> Mapping[str, Any]:
    """What ``Context.save`` recorded of a context besides its cache (``chat``, the caller's notes); {} for a cache
    saved without them.

    Example (with a file ``Context.save`` wrote)::

        print(read_notes("report.kv"))  # {'chat': True, 'source': 'report.txt'}
    """
    return (persist.read_header(path).get("metadata") or {}).get(METADATA_KEY) or {}
