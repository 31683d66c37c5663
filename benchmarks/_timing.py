"""Side-by-side timing: candidates run interleaved, round after round, and compare by median.

Interleaving spreads the noise of a shared machine over every candidate alike, so the printed
ratios mean something even where absolute times drift.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved_medians(
    candidates: dict[str, Callable[[], object]], *, rounds: int, calls: int = 1, warmup: int = 1
) -> dict[str, float]:
    """Median seconds per call of each candidate, measured in alternating rounds."""
    for function in candidates.values():
        for _ in range(warmup):
            function()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for round_index in range(rounds):
        order = list(candidates.items())
        if round_index % 2:
            order.reverse()
        for name, function in order:
            start = time.perf_counter()
            for _ in range(calls):
                function()
            samples[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(values) for name, values in samples.items()}


def verdict(ok: bool) -> str:
    return "meets target" if ok else "MISSES target"
