"""The evaluation runner: generate with each strategy, then score diversity and perplexity.

Prompts are cut into fixed batches, and each prompt samples from its own seed, derived from the
run's seed, the seed's index (``seeds``), the strategy and the prompt's index, so the report does
not depend on the batch size. A sampling strategy generates once per seed (a greedy or beam one
once); each metric is computed per seed on that seed's texts and averaged, with a 95% interval over
prompts and seeds (``decodekit.eval.intervals``).
Under ``accelerate launch`` or ``torchrun`` the batches are dealt out to the processes and gathered
again, so a run on N processes reports what a run on one does.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

import decodekit.eval.diversity as diversity
from decodekit._validation import check_int, check_real
from decodekit.cache.size import full_cache_bytes
from decodekit.eval.grids import as_strategies, default_strategies
from decodekit.eval.intervals import half_samples, intervals
from decodekit.eval.matching import matched_at_diversity
from decodekit.eval.mauve import mauve, text_features
from decodekit.eval.perplexity import continuation_perplexity, perplexity
from decodekit.generation import check_prompts, generate_text
from decodekit.strategies import Strategy

COMPRESSION_RATIOS = (0.0, 0.25, 0.5, 0.75)
SEED_STRIDE = 1_000_003  # between the row seeds of one seed index and the next
METRICS = (
    "distinct_1", "distinct_2", "distinct_2_per_token", "self_bleu", "seq_rep_4", "rep_16", "entropy_2",
    "gzip_ratio", "perplexity", "mean_perplexity", "mauve",
)  # fmt: skip
MEMORY_FRACTIONS = (0.5, 0.25, 0.1)
# Where a metric's values lie, so that an interval never leaves them; MAUVE gets no interval (one
# value clusters every text, about 1.6 s on a CPU, and half-corpora of a few dozen texts are too few
# for its clusters).
RANGES = {
    "distinct_1": (0.0, 1.0), "distinct_2": (0.0, 1.0), "distinct_2_per_token": (0.0, 1.0), "self_bleu": (0.0, 1.0),
    "seq_rep_4": (0.0, 1.0), "rep_16": (0.0, 1.0), "entropy_2": (0.0, None), "gzip_ratio": (0.0, None),
    "perplexity": (1.0, None), "mean_perplexity": (1.0, None),
}  # fmt: skip


@dataclass
class EvaluationReport:
    """Per-strategy metrics, the reference text's perplexity per compression ratio, the settings, and (with
    ``match_diversity``) each sampler's row nearest that diversity."""

    strategies: list[dict[str, Any]] = field(default_factory=list)
    compression: list[dict[str, float]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    generations: dict[str, list[str]] = field(default_factory=dict)
    matched: list[dict[str, Any]] = field(default_factory=list)


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


@dataclass
class _Scored:
    """One strategy's texts per seed, with what the metrics need per text: the negative log-likelihood
    and tokens scored (None for a text with no token) and the MAUVE features (None without them)."""

    texts: list[list[str]]
    nll: list[list[tuple[float, int] | None]]
    features: list[list[torch.Tensor | None]]

    def metrics(self, prompts: list[int], seed: int, human: torch.Tensor | None) -> dict[str, float | None]:
        """Every metric on the texts of ``prompts`` (indices) generated with seed index ``seed`` (MAUVE only
        against ``human`` features)."""
        texts = [self.texts[seed][prompt] for prompt in prompts]
        values: dict[str, float | None] = dict(_diversity(texts))
        scored = [self.nll[seed][prompt] for prompt in prompts if self.nll[seed][prompt] is not None]
        values["perplexity"] = values["mean_perplexity"] = None
        if scored:
            values["perplexity"] = math.exp(sum(nll for nll, _ in scored) / sum(count for _, count in scored))
            values["mean_perplexity"] = statistics.fmean(math.exp(nll / count) for nll, count in scored)
        features = [self.features[seed][prompt] for prompt in prompts if self.features[seed][prompt] is not None]
        values["mauve"] = mauve(torch.stack(features), human) if human is not None and len(features) >= 2 else None
        return values


def _score(model: Any, tokenizer: Any, texts: list[list[str]], with_features: bool, seconds: dict) -> _Scored:
    """Score every text of every seed once (perplexity, MAUVE features), for the metrics to combine;
    the time each takes is added to ``seconds["perplexity"]`` and ``seconds["mauve"]``."""
    flat = [text for seed_texts in texts for text in seed_texts]
    scorable = [index for index, text in enumerate(flat) if tokenizer(text, add_special_tokens=False)["input_ids"]]
    nll: list[tuple[float, int] | None] = [None] * len(flat)
    features: list[torch.Tensor | None] = [None] * len(flat)
    if scorable:
        clock = time.perf_counter()
        result = perplexity([flat[index] for index in scorable], model, tokenizer)
        for index, total, count in zip(scorable, result.text_nll, result.text_tokens, strict=True):
            nll[index] = (total, count)
        seconds["perplexity"] += time.perf_counter() - clock
        if with_features:
            clock = time.perf_counter()
            for index, row in zip(scorable, text_features([flat[i] for i in scorable], model, tokenizer), strict=True):
                features[index] = row
            seconds["mauve"] += time.perf_counter() - clock
    width = len(texts[0])
    per_seed = [slice(start, start + width) for start in range(0, len(flat), width)]
    return _Scored(texts, [nll[part] for part in per_seed], [features[part] for part in per_seed])


def _within(bounds: tuple[float, float] | None, span: tuple[float | None, float | None] | None) -> tuple:
    """``bounds`` cut to the metric's ``span``; (None, None) without bounds."""
    if bounds is None or span is None:
        return None, None
    low, high = bounds
    least, most = span
    if least is not None:
        low, high = max(low, least), max(high, least)
    if most is not None:
        low, high = min(low, most), min(high, most)
    return low, high


def _mean(values: list[float | None]) -> float | None:
    """The mean of the values, or None when any is missing."""
    return None if any(value is None for value in values) else statistics.fmean(values)


def _reference_passages(reference: str, count: int) -> list[str]:
    """Up to ``count`` prose passages of the reference text: the human side of MAUVE."""
    passages = [" ".join(part.split()) for part in reference.split("\n\n")]
    return [passage for passage in passages if len(passage) >= 80][:count]


def _generate_all(
    model, tokenizer, prompts, strategies, *, max_new_tokens, batch_size, seed, seeds, state, progress
) -> dict[str, list[list[str]]]:
    """Per strategy, its texts per seed index (one seed for a strategy that does not sample)."""
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    batches = [prompts[start : start + batch_size] for start in range(0, len(prompts), batch_size)]
    mine = [index for index in range(len(batches)) if index % state.num_processes == state.process_index]
    jobs = [(s, k, b) for s, strategy in enumerate(strategies) for k in range(seeds if strategy.sampling else 1)
            for b in mine]  # fmt: skip
    produced = []
    bar = tqdm(jobs, desc="1/3 generating", unit="batch", disable=not (progress and state.is_main_process))
    for strategy_index, seed_index, batch_index in bar:
        bar.set_postfix_str(strategies[strategy_index].label)
        first = batch_index * batch_size
        base = seed + SEED_STRIDE * seed_index + 100_003 * strategy_index + first
        row_seeds = [base + row for row in range(len(batches[batch_index]))]
        texts = generate_text(
            model, tokenizer, batches[batch_index], strategies[strategy_index], max_new_tokens=max_new_tokens,
            row_seeds=row_seeds,
        )  # fmt: skip
        produced.append((strategy_index, seed_index, batch_index, texts))
    everything = sorted(gather_object(produced) if state.num_processes > 1 else produced)
    return {
        strategy.label: [
            [text for s, k, _, texts in everything if s == index and k == seed_index for text in texts]
            for seed_index in range(seeds if strategy.sampling else 1)
        ]
        for index, strategy in enumerate(strategies)
    }


def evaluate_strategies(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    strategies: Sequence[Strategy | Mapping[str, Any]] | str | Path | None = None,
    *,
    reference: str | None = None,
    max_new_tokens: int = 64,
    batch_size: int = 8,
    seed: int = 0,
    seeds: int = 1,
    resamples: int = 200,
    context_tokens: int = 1024,
    continuation_tokens: int = 256,
    compression_ratios: Sequence[float] = COMPRESSION_RATIOS,
    memory_fractions: Sequence[float] = MEMORY_FRACTIONS,
    match_diversity: float | None = None,
    progress: bool = True,
) -> EvaluationReport:
    """Generate a continuation of every prompt with every strategy and score the results.

    For each strategy: the diversity metrics of its generations, their perplexity under the
    model, and their MAUVE against as many prose passages of the reference text (None when fewer
    than two texts are available). A sampling strategy generates with ``seeds`` seeds; each metric
    is the mean over seeds of its value on one seed's texts, with a 95% interval
    (``<metric>_low``, ``<metric>_high``) from ``resamples`` half-samples of the prompts and
    resamples of the seeds (``decodekit.eval.intervals``; a greedy or beam strategy's text does not
    change with the seed, so its interval is over prompts), cut to the metric's range. MAUVE gets
    no interval (see ``RANGES``). For the reference text (``load_reference()`` by default): the perplexity of
    ``continuation_tokens`` tokens after ``context_tokens`` tokens kept in a CompressedCache at
    each of ``compression_ratios`` (0 is the full cache) and each of ``memory_fractions`` (the
    ``kv_memory_fraction`` field), with the bytes each cache held at the end as a share of a full
    16-bit cache's (``memory``).

    ``strategies`` may be Strategies, rows of a grid (mappings with a ``label``, a ``preset`` and fields,
    as ``decodekit eval --strategies`` reads them; see ``decodekit.eval.grids``) or a grid file's path;
    every row is checked before the first generation. With ``match_diversity`` (a distinct-2 value),
    ``report.matched`` compares the samplers at that diversity: for each sampler, the row of its sweep whose
    distinct-2 is nearest, with its quality and intervals (``decodekit.eval.matching``).

    Example (with ``model`` and ``tokenizer`` from ``load_model``)::

        report = evaluate_strategies(model, tokenizer, load_prompts(), max_new_tokens=32)
        grid = [{"label": f"min-p {p}", "min_p": p, "temperature": 1.0} for p in (0.02, 0.05, 0.1)]
        report = evaluate_strategies(model, tokenizer, load_prompts(), grid, seeds=3, match_diversity=0.8)
        write_reports(report, "reports/")
    """
    from accelerate import PartialState

    from decodekit.eval.data_sources import load_reference

    strategies = as_strategies(strategies) if strategies is not None else default_strategies()
    if match_diversity is not None:
        check_real("match_diversity", match_diversity, 0, 1)
    # Everything that can be checked is checked before the first generation.
    check_prompts(prompts)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_int("batch_size", batch_size, 1)
    check_int("seeds", seeds, 1)
    check_int("resamples", resamples, 2)
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
        seed=seed, seeds=seeds, state=state, progress=progress,
    )  # fmt: skip
    flat = {label: [text for seed_texts in per_seed for text in seed_texts] for label, per_seed in generations.items()}
    report = EvaluationReport(generations=flat)
    report.settings = {
        "prompts": len(prompts), "max_new_tokens": max_new_tokens, "batch_size": batch_size, "seed": seed,
        "seeds": seeds, "resamples": resamples,
        "context_tokens": context_tokens, "continuation_tokens": continuation_tokens, "processes": state.num_processes,
    }  # fmt: skip
    shown = progress and state.is_main_process
    seconds = {"generation": time.perf_counter() - started, "perplexity": 0.0, "mauve": 0.0, "intervals": 0.0,
               "compression": 0.0}  # fmt: skip
    human = _reference_passages(reference, len(prompts))
    clock = time.perf_counter()
    human_features = text_features(human, model, tokenizer) if len(human) >= 2 else None
    seconds["mauve"] += time.perf_counter() - clock
    bar = tqdm(strategies, desc="2/3 scoring", unit="strategy", disable=not shown)
    for strategy in bar:
        bar.set_postfix_str(strategy.label)
        per_seed = generations[strategy.label]
        scored = _score(model, tokenizer, per_seed, human_features is not None, seconds)
        clock = time.perf_counter()  # the estimates' time is MAUVE's: the other metrics take milliseconds
        everything = list(range(len(prompts)))
        by_seed = [scored.metrics(everything, index, human_features) for index in range(len(per_seed))]
        estimates = {name: _mean([values[name] for values in by_seed]) for name in METRICS}
        seconds["mauve"] += time.perf_counter() - clock
        clock = time.perf_counter()
        draws = half_samples(len(prompts), len(per_seed), resamples, seed=seed)
        with_ranges = {name: value for name, value in estimates.items() if name in RANGES}
        bounds = intervals(with_ranges, partial(scored.metrics, human=None), draws)
        row = {"strategy": strategy.label, **strategy.to_dict(), "generated_texts": len(flat[strategy.label]),
               "seeds": len(per_seed),
               "scored_texts": sum(entry is not None for seed_nll in scored.nll for entry in seed_nll)}  # fmt: skip
        for name in METRICS:
            low, high = _within(bounds.get(name), RANGES.get(name))
            row.update({name: estimates[name], f"{name}_low": low, f"{name}_high": high})
        seconds["intervals"] += time.perf_counter() - clock
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
    if match_diversity is not None:
        report.settings["match_diversity"] = match_diversity
        report.matched = matched_at_diversity(report.strategies, match_diversity)
    return report
