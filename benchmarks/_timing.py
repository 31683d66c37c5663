"""Side-by-side timing: candidates run interleaved, round after round, and compare by median.

Interleaving spreads the noise of a shared machine over every candidate alike, so the printed
ratios mean something even where absolute times drift.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import statistics
import time
from collections.abc import Callable

try:
    import resource
except ImportError:  # not on Windows
    resource = None


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


def keep_freed_memory() -> bool:
    """Ask glibc to keep large freed blocks for reuse instead of handing them back to the system.

    By default glibc returns big temporaries to the system and takes fresh pages for the next
    call, depending on a threshold it adjusts as it goes; a candidate's time then changes from one
    run to the next. Pinned, every candidate reuses its memory, as in a long-running process.
    Returns False where the C library has no ``mallopt`` (not glibc).
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    trim_threshold, mmap_threshold = -1, -3  # glibc's M_TRIM_THRESHOLD and M_MMAP_THRESHOLD
    return bool(mallopt(mmap_threshold, 32 * 2**20)) and bool(mallopt(trim_threshold, 2**31 - 1))


def page_faults_per_call(function: Callable[[], object], calls: int = 10) -> float | None:
    """Minor page faults per call: memory the allocator handed back to the system and takes again.

    A candidate that faults on every call pays for fresh pages each time; the count explains a
    time that changes from one run to the next with the allocator's state. None where the
    platform cannot tell.
    """
    if resource is None:
        return None
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        function()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def verdict(ok: bool) -> str:
    return "meets target" if ok else "MISSES target"
