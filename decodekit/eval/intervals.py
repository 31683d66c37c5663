"""95% intervals for an evaluation's metrics, over prompts and seeds.

Most metrics are computed over a corpus (distinct-n counts the unique n-grams of all the texts;
self-BLEU compares each text with the others; MAUVE clusters them all), so a resample that held a
prompt twice would score a repeated text as lost diversity. The intervals therefore come from
half-sampling: each resample takes half the prompts without replacement and the seeds with
replacement, computes the metric per seed on that half-corpus, and averages over the drawn seeds.
For a mean, the spread of half-sample values equals the spread of the full estimate (a half-sample
without replacement has the variance of the whole sample), and a metric's shift from a smaller
corpus is removed by centring: the interval is the estimate plus the 2.5th and 97.5th percentiles of
the resampled values' deviations from their own mean.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence

CONFIDENCE = 0.95


def half_samples(prompts: int, seeds: int, resamples: int, *, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """``resamples`` draws of (half the prompt indices without replacement, the seed indices with replacement).

    Example:
        >>> draws = half_samples(6, 2, resamples=2)
        >>> [(len(p), len(set(p)), len(s)) for p, s in draws]
        [(3, 3, 2), (3, 3, 2)]
    """
    rng = random.Random(seed)
    half = max(1, prompts // 2)
    return [(sorted(rng.sample(range(prompts), half)), [rng.randrange(seeds) for _ in range(seeds)])
            for _ in range(resamples)]  # fmt: skip


def intervals(
    estimates: dict[str, float | None],
    metrics: Callable[[list[int], int], dict[str, float | None]],
    draws: Sequence[tuple[list[int], list[int]]],
    confidence: float = CONFIDENCE,
) -> dict[str, tuple[float, float] | None]:
    """For each named estimate, its ``confidence`` interval: ``metrics(prompt_indices, seed_index)`` gives
    every metric computed on those prompts' texts of that seed (None where one cannot be computed), and
    ``draws`` are the resamples (``half_samples``). None for a metric fewer than two draws give.

    Example:
        >>> values = [[1.0, 2.0, 3.0, 4.0]]  # one seed, four prompts
        >>> mean = lambda prompts, seed: {"mean": statistics.fmean(values[seed][p] for p in prompts)}
        >>> (low, high), = intervals({"mean": 2.5}, mean, half_samples(4, 1, 500)).values()
        >>> 1.0 < low < 2.5 < high < 4.0
        True
    """
    resampled: dict[str, list[float]] = {name: [] for name in estimates}
    for prompts, seeds in draws:
        per_seed = [metrics(prompts, seed) for seed in seeds]
        for name, values in resampled.items():
            drawn = [values_of_seed.get(name) for values_of_seed in per_seed]
            if all(value is not None for value in drawn):
                values.append(statistics.fmean(drawn))
    tail = (1 - confidence) / 2
    result: dict[str, tuple[float, float] | None] = {}
    for name, estimate in estimates.items():
        values = resampled[name]
        if estimate is None or len(values) < 2:
            result[name] = None
            continue
        centre = statistics.fmean(values)
        deviations = sorted(value - centre for value in values)
        result[name] = (estimate + _quantile(deviations, tail), estimate + _quantile(deviations, 1 - tail))
    return result


def _quantile(ordered: Sequence[float], fraction: float) -> float:
    """Linear interpolation between the order statistics of ``ordered`` (sorted)."""
    position = fraction * (len(ordered) - 1)
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)
