"""The evaluation runner: generate with each strategy, then score diversity and perplexity.

Prompts are cut into fixed batches, and each prompt samples from its own seed, derived from the
run's seed, the strategy and the prompt's index, so the report does not depend on the batch size.
Under ``accelerate launch`` or ``torchrun`` the batches are dealt out to the processes and gathered
again, so a run on N processes reports what a run on one does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from decodekit._validation import check_int, check_real
from decodekit.cache.size import full_cache_bytes
from decodekit.eval import diversity
from decodekit.eval.mauve import mauve, text_features
from decodekit.eval.perplexity import continuation_perplexity, perplexity
from decodekit.generation import check_prompts, generate_text
from decodekit.strategies import Strategy

COMPRESSION_RATIOS = (0.0, 0.25, 0.5, 0.75)
MEMORY_FRACTIONS = (0.5, 0.25, 0.1)


def default_strategies() -> list[Strategy]:
    """The grid a plain ``decodekit eval`` compares: greedy, top-p and min-p across temperatures,
    top-n-sigma, XTC, Mirostat and DRY at T=1.0 and 1.5, the staged penalty, beam search with
    each normalization, and the compressed cache."""
    grid = [Strategy(name="greedy")]
    for temperature in (0.7, 1.0, 1.3, 1.5):
        grid.append(Strategy(name=f"top-p 0.9, T={temperature}", temperature=temperature, top_p=0.9))
        grid.append(Strategy(name=f"min-p 0.1, T={temperature}", temperature=temperature, min_p=0.1))
    for temperature in (1.0, 1.5):  # the llama.cpp samplers, at the temperatures where they matter
        grid.append(Strategy(name=f"top-n-sigma 1.0, T={temperature}", temperature=temperature, top_n_sigma=1.0))
        grid.append(Strategy(name=f"XTC 0.1/0.5, T={temperature}", temperature=temperature, xtc_threshold=0.1,
                             xtc_probability=0.5))  # fmt: skip
        grid.append(Strategy(name=f"mirostat 5/0.1, T={temperature}", temperature=temperature, mirostat_tau=5.0,
                             mirostat_eta=0.1))  # fmt: skip
        grid.append(Strategy(name=f"DRY 0.8, T={temperature}", temperature=temperature, dry_multiplier=0.8))
    grid.append(Strategy(name="greedy, staged penalty", staged_penalty="1:1.2,3:1.5,6:2.0", penalty_window=64))
    for normalization in ("none", "average", "gnmt"):
        alpha = None if normalization == "none" else (1.0 if normalization == "average" else 0.6)
        grid.append(
            Strategy(
                name=f"beam 4, {normalization}", num_beams=4, length_normalization=normalization, length_alpha=alpha
            )
        )
    grid.append(Strategy(name="greedy, kv budget 64", kv_budget=64))
    return grid


@dataclass
class EvaluationReport:
    """Per-strategy metrics, the reference text's perplexity per compression ratio, and the settings."""

    strategies: list[dict[str, Any]] = field(default_factory=list)
    compression: list[dict[str, float]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    generations: dict[str, list[str]] = field(default_factory=dict)


def _dynamic_cache_bytes(cache: DynamicCache) -> int:
    """The bytes of a DynamicCache's keys and values."""
    tensors = [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def _diversity(texts: list[str]) -> dict[str, float]:
    return {
        "distinct_1": diversity.distinct_n(texts, 1),
        "distinct_2": diversity.distinct_n(texts, 2),
        "distinct_2_per_token": diversity.distinct_n(texts, 2, per="tokens"),
        "self_bleu": diversity.self_bleu(texts) if len(texts) > 1 else 0.0,
        "seq_rep_4": diversity.seq_rep_n(texts, 4),
        "rep_16": diversity.rep_window(texts, 16),
        "entropy_2": diversity.ngram_entropy(texts, 2),
        "gzip_ratio": diversity.compression_ratio(texts),
    }


def _generation_perplexity(model: Any, tokenizer: Any, scorable: list[str]) -> dict[str, float | None]:
    """Corpus and mean perplexity of the generations that hold a token (None when none does)."""
    if not scorable:
        return {"perplexity": None, "mean_perplexity": None, "scored_texts": 0}
    result = perplexity(scorable, model, tokenizer)
    return {
        "perplexity": result.corpus_perplexity,
        "mean_perplexity": result.mean_perplexity,
        "scored_texts": len(scorable),
    }


def _reference_passages(reference: str, count: int) -> list[str]:
    """Up to ``count`` prose passages of the reference text: the human side of MAUVE."""
    passages = [" ".join(part.split()) for part in reference.split("\n\n")]
    return [passage for passage in passages if len(passage) >= 80][:count]


def _generate_all(model, tokenizer, prompts, strategies, *, max_new_tokens, batch_size, seed, state, progress):
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    batches = [prompts[start : start + batch_size] for start in range(0, len(prompts), batch_size)]
    mine = [index for index in range(len(batches)) if index % state.num_processes == state.process_index]
    jobs = [(s, b) for s in range(len(strategies)) for b in mine]
    produced = []
    bar = tqdm(jobs, desc="1/3 generating", unit="batch", disable=not (progress and state.is_main_process))
    for strategy_index, batch_index in bar:
        bar.set_postfix_str(strategies[strategy_index].label)
        first = batch_index * batch_size
        row_seeds = [seed + 100_003 * strategy_index + first + row for row in range(len(batches[batch_index]))]
        texts = generate_text(
            model, tokenizer, batches[batch_index], strategies[strategy_index], max_new_tokens=max_new_tokens,
            row_seeds=row_seeds,
        )  # fmt: skip
        produced.append((strategy_index, batch_index, texts))
    everything = sorted(gather_object(produced) if state.num_processes > 1 else produced)
    return {
        strategy.label: [text for s, _, texts in everything if s == index for text in texts]
        for index, strategy in enumerate(strategies)
    }


def evaluate_strategies(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    strategies: Sequence[Strategy] | None = None,
    *,
    reference: str | None = None,
    max_new_tokens: int = 64,
    batch_size: int = 8,
    seed: int = 0,
    context_tokens: int = 1024,
    continuation_tokens: int = 256,
    compression_ratios: Sequence[float] = COMPRESSION_RATIOS,
    memory_fractions: Sequence[float] = MEMORY_FRACTIONS,
    progress: bool = True,
) -> EvaluationReport:
    """Generate a continuation of every prompt with every strategy and score the results.

    For each strategy: the diversity metrics of its generations, their perplexity under the
    model, and their MAUVE against as many prose passages of the reference text (None when fewer
    than two texts are available). For the reference text (``load_reference()`` by default): the perplexity of
    ``continuation_tokens`` tokens after ``context_tokens`` tokens kept in a CompressedCache at
    each of ``compression_ratios`` (0 is the full cache) and each of ``memory_fractions`` (the
    ``kv_memory_fraction`` field), with the bytes each cache held at the end as a share of a full
    16-bit cache's (``memory``).

    Example (with ``model`` and ``tokenizer`` from ``load_model``)::

        report = evaluate_strategies(model, tokenizer, load_prompts(), max_new_tokens=32)
        write_reports(report, "reports/")
    """
    from accelerate import PartialState

    from decodekit.eval.data_sources import load_reference

    strategies = list(strategies) if strategies is not None else default_strategies()
    labels = [strategy.label for strategy in strategies]
    if len(set(labels)) != len(labels):
        raise ValueError("strategies must have distinct labels: give each a name")
    # Everything that can be checked is checked before the first generation.
    check_prompts(prompts)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_int("batch_size", batch_size, 1)
    check_int("context_tokens", context_tokens, 1)
    check_int("continuation_tokens", continuation_tokens, 1)
    ratios = [check_real("compression_ratios[]", ratio, 0, 1, high_open=True) for ratio in compression_ratios]
    caches = [Strategy(kv_compression_ratio=ratio) if ratio else None for ratio in ratios]
    caches += [Strategy(kv_memory_fraction=fraction) for fraction in memory_fractions]  # checked by the field
    reference = reference if reference is not None else load_reference()
    ids = tokenizer(reference, add_special_tokens=False)["input_ids"]
    if len(ids) < context_tokens + continuation_tokens:
        raise ValueError(
            f"the reference text has {len(ids)} tokens; context_tokens + continuation_tokens = "
            f"{context_tokens} + {continuation_tokens} needs that many: lower them or give a longer reference"
        )
    from tqdm.auto import tqdm

    state = PartialState(cpu=not torch.cuda.is_available())
    started = time.perf_counter()
    generations = _generate_all(
        model, tokenizer, list(prompts), strategies, max_new_tokens=max_new_tokens, batch_size=batch_size,
        seed=seed, state=state, progress=progress,
    )  # fmt: skip
    report = EvaluationReport(generations=generations)
    report.settings = {
        "prompts": len(prompts), "max_new_tokens": max_new_tokens, "batch_size": batch_size, "seed": seed,
        "context_tokens": context_tokens, "continuation_tokens": continuation_tokens, "processes": state.num_processes,
    }  # fmt: skip
    shown = progress and state.is_main_process
    seconds = {"generation": time.perf_counter() - started, "perplexity": 0.0, "mauve": 0.0, "compression": 0.0}
    human = _reference_passages(reference, len(prompts))
    clock = time.perf_counter()
    human_features = text_features(human, model, tokenizer) if len(human) >= 2 else None
    seconds["mauve"] += time.perf_counter() - clock
    bar = tqdm(strategies, desc="2/3 scoring", unit="strategy", disable=not shown)
    for strategy in bar:
        bar.set_postfix_str(strategy.label)
        texts = generations[strategy.label]
        row = {"strategy": strategy.label, **strategy.to_dict(), "generated_texts": len(texts)}
        row.update(_diversity(texts))
        scorable = [text for text in texts if tokenizer(text, add_special_tokens=False)["input_ids"]]
        clock = time.perf_counter()
        row.update(_generation_perplexity(model, tokenizer, scorable))
        seconds["perplexity"] += time.perf_counter() - clock
        clock = time.perf_counter()
        row["mauve"] = (
            mauve(text_features(scorable, model, tokenizer), human_features)
            if human_features is not None and len(scorable) >= 2
            else None
        )
        seconds["mauve"] += time.perf_counter() - clock
        report.strategies.append(row)
    context = torch.tensor([ids[:context_tokens]], device=model.device)
    continuation = torch.tensor([ids[context_tokens : context_tokens + continuation_tokens]], device=model.device)
    clock = time.perf_counter()
    full16 = full_cache_bytes(model, context.shape[1] + continuation.shape[1], element_size=2)
    bar = tqdm(caches, desc="3/3 KV-cache compression", unit="cache", disable=not shown)
    for strategy in bar:
        bar.set_postfix_str(strategy.label if strategy else "full cache")
        cache = DynamicCache() if strategy is None else strategy.plan(model).cache
        value = continuation_perplexity(model, cache, context, continuation)
        held = cache.memory_bytes() if strategy else _dynamic_cache_bytes(cache)
        report.compression.append({
            "compression_ratio": strategy.kv_compression_ratio if strategy else 0.0,
            "memory_fraction": strategy.kv_memory_fraction if strategy else None,
            "memory": held / full16, "perplexity": value,
        })  # fmt: skip
    seconds["compression"] = time.perf_counter() - clock
    report.settings["seconds"] = {phase: round(value, 1) for phase, value in seconds.items()}
    return report
