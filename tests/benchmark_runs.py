"""Running a benchmark script as a test does: a short configuration, its output read back (its figures are
not asserted; the scripts are run by ``tests/test_benchmark*.py``, split so that pytest-xdist spreads them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, args: tuple[str, ...], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def run_benchmark(script: str, *args: str) -> str:
    """The standard output of ``benchmarks/<script> <args>``; fails the test when the script fails."""
    # The timeout only guards against a hang: the longest run takes a few minutes on a shared 2-core machine.
    result = _run(script, args, timeout=1200)
    assert result.returncode == 0, result.stderr
    return result.stdout


def refused_benchmark(script: str, *args: str) -> str:
    """The standard error of ``benchmarks/<script> <args>``, which must refuse them (exit status 2, argparse's)."""
    result = _run(script, args, timeout=300)  # refused before the model loads
    assert result.returncode == 2, result.stderr
    return result.stderr
