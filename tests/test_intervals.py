"""Half-sample intervals: their draws, and their coverage of a known mean (a statistical oracle)."""

from __future__ import annotations

import random
import statistics

from decodekit.eval.intervals import half_samples, intervals


def test_half_samples_take_half_the_prompts_without_replacement_and_seeds_with_replacement():
    draws = half_samples(10, 3, 200, seed=1)
    assert len(draws) == 200
    assert all(len(prompts) == 5 == len(set(prompts)) for prompts, _ in draws)
    assert all(len(seeds) == 3 and set(seeds) <= {0, 1, 2} for _, seeds in draws)
    assert any(len(set(seeds)) < 3 for _, seeds in draws)  # seeds repeat
    assert draws == half_samples(10, 3, 200, seed=1)


def test_a_95_percent_interval_of_a_mean_covers_the_true_mean_about_95_times_in_100():
    rng = random.Random(0)
    covered = 0
    trials = 300
    for trial in range(trials):
        values = [[rng.gauss(5.0, 2.0) for _ in range(40)]]
        estimate = statistics.fmean(values[0])

        def mean(prompts, seed, values=values):
            return {"mean": statistics.fmean(values[seed][p] for p in prompts)}

        ((low, high),) = intervals({"mean": estimate}, mean, half_samples(40, 1, 200, seed=trial)).values()
        covered += low <= 5.0 <= high
    assert 0.90 <= covered / trials <= 0.99


def test_a_missing_value_gives_no_interval():
    bounds = intervals({"a": None, "b": 1.0}, lambda prompts, seed: {"a": None, "b": None}, half_samples(4, 1, 10))
    assert bounds == {"a": None, "b": None}
