"""Reports of an evaluation: JSON and CSV tables and two PNG plots."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from decodekit.eval.runner import EvaluationReport

REPORT_FILES = ("report.json", "report.csv", "frontier.png", "compression.png")
STAGING_PREFIX = ".decodekit-reports-"


def check_output_dir(directory: str | Path) -> Path:
    """``directory`` as a Path, or a ValueError now if reports could not be written there later.

    Example:
        >>> check_output_dir("reports").name
        'reports'
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--out {directory} is a file: name a folder for the reports")
    existing = directory
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--out {directory} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {directory} cannot be written: {existing} is not writable")
    return directory


def write_reports(report: EvaluationReport, directory: str | Path) -> dict[str, Path]:
    """Write report.json, report.csv, frontier.png and compression.png into ``directory``; return their paths.

    The four are written as a set: into a hidden staging folder first, then moved into place
    with Ctrl-C held back, so an interrupted run leaves the previous complete set, never a mix.
    """
    directory = check_output_dir(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"{STAGING_PREFIX}*"):  # left by a run that was killed outright
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=directory))
    try:
        staged = {name: staging / name for name in REPORT_FILES}
        staged["report.json"].write_text(json.dumps(report.__dict__, indent=2, ensure_ascii=False) + "\n")
        columns = list(dict.fromkeys(key for row in report.strategies for key in row))
        with staged["report.csv"].open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(report.strategies)
        plot_frontier(report, staged["frontier.png"])
        plot_compression(report, staged["compression.png"])
        with _interrupts_held():
            for name, path in staged.items():
                os.replace(path, directory / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {name: directory / name for name in REPORT_FILES}


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Delay Ctrl-C (SIGINT) until the block ends; a no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: received.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_frontier(report: EvaluationReport, path: Path) -> None:
    """Quality (perplexity of the generations, lower is better) against diversity (distinct-2):
    top-p and min-p each as a line across temperatures, the other strategies as points."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 5))
    rows = [row for row in report.strategies if row.get("perplexity") is not None]
    for family, marker in (("top_p", "o-"), ("min_p", "s-")):
        series = sorted((row for row in rows if family in row), key=lambda row: row.get("temperature", 1.0))
        if series:
            axes.plot([r["distinct_2"] for r in series], [r["perplexity"] for r in series], marker, label=family)
            for row in series:
                axes.annotate(f"T={row.get('temperature', 1.0)}", (row["distinct_2"], row["perplexity"]), fontsize=7)
    for row in rows:
        if "top_p" not in row and "min_p" not in row:
            axes.plot(row["distinct_2"], row["perplexity"], "x", color="gray")
            axes.annotate(row["strategy"], (row["distinct_2"], row["perplexity"]), fontsize=7, color="gray")
    axes.set_xlabel("diversity: distinct-2 (unique / all bigrams)")
    axes.set_ylabel("perplexity of the generations under the model")
    axes.set_yscale("log")
    axes.set_title("Quality-diversity frontier")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_compression(report: EvaluationReport, path: Path) -> None:
    """Perplexity of the reference continuation against the share of the KV cache evicted."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    points = sorted((row["compression_ratio"], row["perplexity"]) for row in report.compression)
    axes.plot([ratio for ratio, _ in points], [value for _, value in points], "o-")
    axes.set_xlabel("share of the context evicted (CompressedCache compression_ratio)")
    axes.set_ylabel("perplexity of the reference continuation")
    axes.set_title("Perplexity against KV-cache compression")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
