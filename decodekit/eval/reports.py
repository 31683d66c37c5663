"""Reports of an evaluation: JSON and CSV tables and two PNG plots."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from decodekit.eval.matching import family_key, is_sampling
from decodekit.eval.runner import EvaluationReport
from decodekit.fields import BY_NAME

REPORT_FILES = ("report.json", "report.csv", "frontier.png", "temperature.png", "compression.png")
MATCHED_FILE = "matched.png"  # with match_diversity only
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
    """Write report.json, report.csv, frontier.png, temperature.png and compression.png into ``directory``,
    and matched.png when the report compares samplers at a matched diversity; return their paths.

    The files are written as a set: into a hidden staging folder first, then moved into place
    with Ctrl-C held back, so an interrupted run leaves the previous complete set, never a mix (a
    matched.png left by an earlier run is removed when this report has none).
    """
    directory = check_output_dir(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"{STAGING_PREFIX}*"):  # left by a run that was killed outright
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=directory))
    try:
        names = REPORT_FILES + ((MATCHED_FILE,) if report.matched else ())
        staged = {name: staging / name for name in names}
        staged["report.json"].write_text(json.dumps(report.__dict__, indent=2, ensure_ascii=False) + "\n")
        columns = list(dict.fromkeys(key for row in report.strategies for key in row))
        with staged["report.csv"].open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(report.strategies)
        plot_frontier(report, staged["frontier.png"])
        _save(temperature_figure(report), staged["temperature.png"])
        plot_compression(report, staged["compression.png"])
        if report.matched:
            _save(matched_figure(report), staged[MATCHED_FILE])
        with _interrupts_held():
            for name, path in staged.items():
                os.replace(path, directory / name)
            if not report.matched:
                (directory / MATCHED_FILE).unlink(missing_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {name: directory / name for name in names}


def read_report(path: str | Path) -> EvaluationReport:
    """A report written by :func:`write_reports`, read back from its report.json (or the folder holding
    it), to be analysed again: matched at another diversity, plotted again.

    Example::

        report = read_report("reports/")
        report.matched = matched_at_diversity(report.strategies, 0.8)
        write_reports(report, "reports-at-0.8/")
    """
    path = Path(path)
    path = path / "report.json" if path.is_dir() else path
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable report.json ({error})") from None
    fields = {name: data[name] for name in ("strategies", "compression", "settings", "generations", "matched")
              if name in data}  # fmt: skip
    return EvaluationReport(**fields)


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


MARKERS = "os^vDP*hX<>p"
POINT_MARKERS = "xD^v<>P*hX"


def _sweeps(rows: list[dict], free: tuple[str, ...]) -> list[list[dict]]:
    """The rows grouped into sweeps (``decodekit.eval.matching.family_key``), in the order they first appear."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((*family_key(row, free=free), ("sampling", is_sampling(row))), []).append(row)
    return list(groups.values())


# What a sweep appends to the name of its rows' recipe: ", T=0.7" or " T=0.7" (the built-in grids), ", temperature=0.7"
# (--sweep).
SWEPT_SUFFIX = re.compile(r"(,?\s*(T|temperature)=[0-9.e+-]+)+$")


def _shared_name(members: list[dict]) -> str | None:
    """The name the rows of a sweep share before what the sweep appended (", T=0.7"), or None."""
    names = {SWEPT_SUFFIX.sub("", str(row["strategy"])) for row in members}
    if len(names) == 1 and "" not in names and len(members) > 1 and names != {members[0]["strategy"]}:
        return names.pop()
    return None


def _sweep_name(members: list[dict], varying: list[str]) -> str:
    """A sweep's legend entry: the name its rows share before ", T=" (as the built-in grids and named sweeps name
    them), else its fixed fields, then the varying ones."""
    shared = _shared_name(members)
    if shared is not None:
        return shared
    fixed = [f"{name}={_shown(members[0][name])}" for name in _fields(members[0]) if name not in varying]
    return ", ".join(fixed + [f"{name} swept" for name in varying if name != "temperature"]) or "sampling"


def _fields(row: dict) -> list[str]:
    return [name for name in row if name in BY_NAME and row[name] is not None]


def _varying(members: list[dict]) -> list[str]:
    names = dict.fromkeys(name for row in members for name in _fields(row))
    return [name for name in names if len({repr(row.get(name)) for row in members}) > 1]


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _point_label(row: dict, varying: list[str], named: bool = False) -> str:
    """What varies along a sweep at this point: ``T=0.7``, ``min_p=0.05, T=1``; a row of the grid's own label
    (``named``: the sweep's rows do not share one name) shows its label first: ``cautious (min_p=0.2)``."""
    parts = []
    for name in varying:
        value = row.get(name, 1.0 if name == "temperature" else None)
        parts.append(f"{'T' if name == 'temperature' else name}={_shown(value)}")
    fields = ", ".join(parts)
    return f"{row['name']} ({fields})" if named and row.get("name") else fields


def frontier_figure(report: EvaluationReport):
    """Quality against diversity: each strategy's perplexity (lower is better) over its distinct-2 (higher
    is more diverse), for any grid. The rows of one sweep (the same fields, whatever their numbers and
    temperature: top-p across temperatures, min-p across its values) are a line, each point marked with
    what varies; every other strategy is a point with its own legend entry, strategies that land on the
    same point sharing one."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 5.5))
    rows = [row for row in report.strategies if row.get("perplexity") is not None and row.get("distinct_2") is not None]
    points: dict[tuple[float, float], list[str]] = {}
    lines = 0
    for members in _sweeps(rows, free=()):
        varying = _varying(members)
        if len(members) < 2 or not varying:  # no sweep: points, those that coincide sharing a legend entry
            for row in members:
                spot = (round(row["distinct_2"], 6), round(row["perplexity"], 6))
                points.setdefault(spot, []).append(row["strategy"])
            continue
        members = sorted(members, key=lambda row: row["distinct_2"])
        named = _shared_name(members) is None  # (rows named each on its own: their labels on their points)
        offset = 8 if lines % 2 == 0 else -12
        axes.plot([r["distinct_2"] for r in members], [r["perplexity"] for r in members],
                  MARKERS[lines % len(MARKERS)] + "-", label=_sweep_name(members, varying))  # fmt: skip
        for row in members:  # alternate sweeps label above and below their points
            axes.annotate(_point_label(row, varying, named), (row["distinct_2"], row["perplexity"]),
                          textcoords="offset points", xytext=(0, offset), ha="center", fontsize=6)  # fmt: skip
        lines += 1
    for index, ((x, y), labels) in enumerate(points.items()):
        marker = POINT_MARKERS[index % len(POINT_MARKERS)]
        axes.plot(x, y, marker, linestyle="none", markersize=8, label=" = ".join(labels))
    for row in rows:
        _error_bars(axes, row, "distinct_2", "perplexity")
    axes.set_xlabel("diversity: distinct-2, unique / all bigrams (higher: more diverse)")
    axes.set_ylabel("perplexity of the generations, log scale (lower: more fluent)")
    axes.set_yscale("log")
    axes.set_title("Quality-diversity frontier (better: right and down)")
    if rows:
        axes.legend(fontsize=7, loc="best")
    figure.tight_layout()
    return figure


def _error_bars(axes, row: dict, x: str, y: str) -> None:
    """Grey 95% interval bars on a point (``<metric>_low``/``_high``), where the row has them."""
    bounds = {name: (row.get(f"{name}_low"), row.get(f"{name}_high")) for name in (x, y)}
    if row.get(x) is None or row.get(y) is None:
        return
    spans = {}
    for name, (low, high) in bounds.items():
        spans[name] = None if low is None or high is None else [[row[name] - low], [high - row[name]]]
    if spans[x] is None and spans[y] is None:
        return
    axes.errorbar(row[x], row[y], xerr=spans[x], yerr=spans[y], fmt="none", ecolor="gray", alpha=0.6,
                  elinewidth=0.8, capsize=2)  # fmt: skip


def temperature_figure(report: EvaluationReport):
    """Each recipe across temperatures: distinct-2 (top) and the generations' perplexity (bottom, log),
    with their 95% intervals, for any grid. A line is the rows that differ only in temperature (a sweep of
    ``temperature``, or the built-in grids' "<sampler>, T=<t>" rows); recipes run at one temperature only
    are left out."""
    plt = _pyplot()
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    families: dict[tuple, list[dict]] = {}
    for row in report.strategies:
        if row.get("temperature") is not None:
            key = tuple((name, repr(row[name])) for name in _fields(row) if name != "temperature")
            families.setdefault(key, []).append(row)
    drawn = 0
    for members in families.values():
        if len({row["temperature"] for row in members}) < 2:
            continue
        members = sorted(members, key=lambda row: row["temperature"])
        name = _sweep_name(members, ["temperature"])
        if name == "sampling":
            fixed = [f"{field}={_shown(members[0][field])}" for field in _fields(members[0]) if field != "temperature"]
            name = ", ".join(fixed) or "temperature only"
        marker = POINT_MARKERS[drawn % len(POINT_MARKERS)] + "-"
        for axes, metric in ((top, "distinct_2"), (bottom, "perplexity")):
            points = [row for row in members if row.get(metric) is not None]
            axes.plot([row["temperature"] for row in points], [row[metric] for row in points], marker, label=name)
            for row in points:
                _error_bars(axes, {**row, "t": row["temperature"]}, "t", metric)
        drawn += 1
    top.set_ylabel("distinct-2 (higher: more diverse)")
    bottom.set_ylabel("perplexity, log scale (lower: more fluent)")
    bottom.set_yscale("log")
    bottom.set_xlabel("temperature")
    top.set_title("Samplers across temperatures (bars: 95% intervals over prompts and seeds)")
    if drawn:
        top.legend(fontsize=7, ncol=2, loc="best")
    else:
        top.text(0.5, 0.5, "no recipe was run at two temperatures or more", ha="center", transform=top.transAxes)
    figure.tight_layout()
    return figure


def matched_figure(report: EvaluationReport):
    """Quality at matched diversity: each sampler's perplexity (log) with its 95% interval, at the row of
    its sweep whose distinct-2 is nearest the target (``report.matched``), best first; each bar names the
    row and its distinct-2, hollow where the target lies outside the sampler's sweep, grey where it lies outside
    the row's interval too (not compared).

    Example:
        >>> from decodekit.eval.matching import matched_at_diversity
        >>> rows = [{"strategy": "a", "min_p": 0.1, "distinct_2": 0.8, "perplexity": 9.0}]
        >>> report = EvaluationReport(strategies=rows, matched=matched_at_diversity(rows, 0.8))
        >>> [tick.get_text() for tick in matched_figure(report).axes[0].get_yticklabels()]
        ['min_p']
    """
    plt = _pyplot()
    matched = report.matched
    figure, axes = plt.subplots(figsize=(8, 1.2 + 0.45 * max(1, len(matched))))
    for index, entry in enumerate(matched):
        low, high, value = entry.get("perplexity_low"), entry.get("perplexity_high"), entry["perplexity"]
        span = None if low is None or high is None else [[value - low], [high - value]]
        color = "C0" if entry.get("compared", True) else "C7"
        axes.errorbar(value, index, xerr=span, fmt="o", color=color, capsize=3,
                      markerfacecolor=color if entry["within"] else "white")  # fmt: skip
        axes.annotate(f"{entry['strategy']}: distinct-2 {entry['distinct_2']:.3f}", (value, index),
                      textcoords="offset points", xytext=(8, 4), fontsize=7)  # fmt: skip
    axes.set_yticks(range(len(matched)), [entry["sampler"] for entry in matched], fontsize=8)
    axes.invert_yaxis()
    axes.set_xscale("log")
    left, right = axes.get_xlim()
    axes.set_xlim(left, right * (right / left) ** 0.35)  # (room for the last bar's words)
    axes.set_xlabel("perplexity of the generations at the matched diversity, log scale (lower: more fluent)")
    target = report.settings.get("match_diversity", matched[0]["target"] if matched else None)
    axes.set_title(f"Quality at matched diversity: each sampler's row nearest distinct-2 = {target}\n"
                   "(bars: 95% intervals over prompts and seeds; hollow: the target lies outside its sweep;\n"
                   "grey: outside its row's distinct-2 interval too, not compared)",
                   fontsize=9)  # fmt: skip
    figure.tight_layout()
    return figure


def plot_frontier(report: EvaluationReport, path: Path) -> None:
    """Save :func:`frontier_figure` as a PNG."""
    _save(frontier_figure(report), path)


def compression_figure(report: EvaluationReport):
    """The reference continuation's perplexity against the memory each cache held, as a share of a full
    16-bit cache's bytes: one line for the evicting caches (``compression_ratio``, stored in the model's
    dtype) and one for the byte-sized ones (``memory_fraction``), the full cache's value as a baseline
    and each point's change from it, on an axis spanning at least +-5% of the baseline so that noise
    does not look like a trend."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6.5, 4.5))
    rows = report.compression
    baseline = next((row["perplexity"] for row in rows if _is_full(row)), None)
    series = {
        "evicting (compression_ratio)": [row for row in rows if not row.get("memory_fraction") and not _is_full(row)],
        "sized in bytes (memory_fraction)": [row for row in rows if row.get("memory_fraction")],
    }
    values = [row["perplexity"] for row in rows]
    for label, members in series.items():
        points = sorted((_memory(row), row["perplexity"]) for row in members)
        if not points:
            continue
        axes.plot([x for x, _ in points], [y for _, y in points], "o-", label=label)
        for x, y in points if baseline is not None else ():
            axes.annotate(f"{(y / baseline - 1):+.1%}", (x, y), textcoords="offset points", xytext=(0, 8),
                          ha="center", fontsize=8)  # fmt: skip
    if baseline is not None:
        axes.axhline(baseline, color="gray", linestyle="--", label=f"full cache ({baseline:.2f})")
        low, high = min([*values, baseline * 0.95]), max([*values, baseline * 1.05])
        margin = 0.05 * (high - low)
        axes.set_ylim(low - margin, high + margin)
    axes.set_xlabel("memory held: share of a full 16-bit cache's bytes")
    axes.set_ylabel("perplexity of the reference continuation (lower: better)")
    axes.set_title("Perplexity against KV-cache memory")
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


def _is_full(row: dict) -> bool:
    return row.get("compression_ratio") == 0 and not row.get("memory_fraction")


def _memory(row: dict) -> float:
    """A compression row's memory share (reports written before it was measured: the share of tokens kept)."""
    return row["memory"] if row.get("memory") is not None else 1 - row["compression_ratio"]


def plot_compression(report: EvaluationReport, path: Path) -> None:
    """Save :func:`compression_figure` as a PNG."""
    _save(compression_figure(report), path)


def _save(figure, path: Path) -> None:
    figure.savefig(path, dpi=120)
    _pyplot().close(figure)
