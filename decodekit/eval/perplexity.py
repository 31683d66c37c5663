"""Perplexity of texts under a causal language model, with a sliding window for long texts.

The method is transformers' "Perplexity of fixed-length models": a text longer than
``max_length`` tokens is scored in windows of ``max_length`` tokens that advance by ``stride``;
each window scores only the tokens the previous windows did not, with the tokens before them as
context. Windows of all texts are batched together (right-padded) for throughput.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional

from decodekit._validation import check_int
from decodekit.cache import CompressedCache


@dataclass(frozen=True)
class PerplexityResult:
    """Per-text perplexities and the corpus perplexity exp(total NLL / total scored tokens).

    The corpus value weighs texts by their length; ``mean_perplexity`` is the plain mean of the
    per-text values (what evaluate's canonical metric reports), given for comparison.
    """

    perplexities: list[float]
    corpus_perplexity: float
    mean_perplexity: float
    total_nll: float
    scored_tokens: int
    text_nll: list[float] = field(default_factory=list)  # per text: its summed negative log-likelihood
    text_tokens: list[int] = field(default_factory=list)  # per text: the tokens scored


def _windows(ids: list[int], max_length: int, stride: int) -> list[tuple[list[int], int]]:
    """(window token ids, how many of its last tokens it scores) for one text."""
    windows, scored_until = [], 1  # the first token has no context: never scored
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        if end > scored_until:
            # A window's first token has no context in it; with stride == max_length it goes unscored.
            windows.append((ids[begin:end], min(end - scored_until, end - begin - 1)))
            scored_until = end
        if end == len(ids):
            break
    return windows


def perplexity(
    texts: Sequence[str],
    model: Any,
    tokenizer: Any = None,
    *,
    max_length: int | None = None,
    stride: int | None = None,
    add_bos: bool = True,
    batch_size: int = 8,
) -> PerplexityResult:
    """Perplexity of each text and of the corpus under ``model``.

    Args:
        texts: the texts to score (non-empty strings).
        model: a causal LM (the evaluate module ``metric_path("perplexity")`` also takes a name
            or path and loads it).
        tokenizer: the model's tokenizer.
        max_length: tokens per window; default the model's context length (at most 1024).
        stride: how far a window advances, 1..max_length; default ``max_length // 2``.
        add_bos: put the tokenizer's BOS token first (when it has one and does not add it
            itself), so that the text's first token is scored too; otherwise the first token is
            only context.
        batch_size: windows per forward pass.

    Example (with ``model`` and ``tokenizer`` from ``load_model``)::

        result = perplexity(["The sea is calm tonight."], model, tokenizer)
        print(result.perplexities[0], result.corpus_perplexity)
    """
    if model is None or isinstance(model, str) or not hasattr(model, "config"):
        raise TypeError(
            "model must be a loaded causal LM (from decodekit.load_model or from_pretrained); to score with a "
            "model given by name, use the evaluate module metric_path('perplexity')"
        )
    if tokenizer is None:
        raise ValueError("tokenizer is required: pass the model's tokenizer")
    if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts:
        raise ValueError("texts must be a non-empty list of strings")
    context = min(getattr(model.config, "max_position_embeddings", 1024) or 1024, 1024)
    max_length = check_int("max_length", max_length if max_length is not None else context, 2)
    stride = check_int("stride", stride if stride is not None else max(1, max_length // 2), 1)
    if stride > max_length:
        raise ValueError(f"stride must be <= max_length ({max_length}); got {stride}")
    check_int("batch_size", batch_size, 1)

    bos = tokenizer.bos_token_id if add_bos else None
    jobs = []  # (text index, window ids, scored count)
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{index}] must be a string; got {type(text).__name__}")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        if len(ids) < 2:
            raise ValueError(f"texts[{index}] has no token to score: it needs at least one token after the first")
        jobs.extend((index, window, scored) for window, scored in _windows(ids, max_length, stride))

    nll = [0.0] * len(texts)
    counts = [0] * len(texts)
    device = next(model.parameters()).device
    jobs.sort(key=lambda job: len(job[1]))
    with torch.inference_mode():
        for start in range(0, len(jobs), batch_size):
            batch = jobs[start : start + batch_size]
            width = max(len(window) for _, window, _ in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            for row, (_, window, scored) in enumerate(batch):
                ids[row, : len(window)] = torch.tensor(window)
                mask[row, : len(window)] = 1
                labels[row, len(window) - scored : len(window)] = torch.tensor(window[len(window) - scored :])
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
            token_nll = functional.cross_entropy(
                logits[:, :-1].transpose(1, 2), labels[:, 1:].to(device), ignore_index=-100, reduction="none"
            )
            for row, (index, _, scored) in enumerate(batch):
                nll[index] += float(token_nll[row].sum())
                counts[index] += scored
    perplexities = [math.exp(total / count) for total, count in zip(nll, counts, strict=True)]
    return PerplexityResult(
        perplexities=perplexities,
        corpus_perplexity=math.exp(sum(nll) / sum(counts)),
        mean_perplexity=sum(perplexities) / len(perplexities),
        total_nll=sum(nll),
        scored_tokens=sum(counts),
        text_nll=nll,
        text_tokens=counts,
    )


def continuation_perplexity(model: Any, cache: Any, context: torch.Tensor, continuation: torch.Tensor) -> float:
    """Perplexity of ``continuation`` ([1, n] ids) after ``context`` ([1, m] ids) prefilled through ``cache``.

    The continuation is scored in one forward pass with explicit positions, so it attends to what
    the cache kept of the context and to itself; its first token is predicted by the prefill. A compressed cache's
    context ends with the prefill: the continuation is not replayed as context would be.
    """
    with torch.inference_mode():
        prefill = model(context, past_key_values=cache)
        if isinstance(cache, CompressedCache):
            cache.end_context()
        positions = torch.arange(context.shape[1], context.shape[1] + continuation.shape[1], device=context.device)
        logits = model(continuation, past_key_values=cache, position_ids=positions.unsqueeze(0)).logits
    logits = torch.cat([prefill.logits[:, -1:], logits[:, :-1]], dim=1).float()
    return math.exp(functional.cross_entropy(logits[0], continuation[0]).item())
