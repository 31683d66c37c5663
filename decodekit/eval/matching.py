"""Samplers compared at equal diversity, each with its own hyperparameters tuned.

A comparison of samplers at their usual settings mixes two things: how diverse each one's text is and
how good it is at that diversity. Moving along one sampler's sweep trades one for the other, so a sampler
can look more fluent only because it is less diverse. "Turning Down the Heat" (arXiv 2506.13681) found
that min-p's reported gains vanished once the comparison held this fixed and tuned every sampler, not
only the new one. Here each sampler's rows (its sweep: the rows that set the same fields, with the same
non-numeric values, whatever their numbers and temperature) give the row whose distinct-2 is nearest the
target, and the samplers' quality is compared there, with the rows' 95% intervals.

Example:
    >>> rows = [{"strategy": f"min-p {p}", "min_p": p, "temperature": 1.0, "distinct_2": d, "perplexity": q}
    ...         for p, d, q in ((0.2, 0.70, 6.0), (0.1, 0.78, 9.0), (0.05, 0.83, 13.0))]
    >>> rows.append({"strategy": "top-p 0.9", "top_p": 0.9, "temperature": 1.0, "distinct_2": 0.84, "perplexity": 16.0})
    >>> [(m["sampler"], m["strategy"], m["candidates"]) for m in matched_at_diversity(rows, 0.8)]
    [('min_p', 'min-p 0.1', 3), ('top_p', 'top-p 0.9', 1)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from decodekit.fields import BY_NAME

NUMBERS = ("real", "integer")


def family_key(row: dict[str, Any], free: Sequence[str] = ()) -> tuple:
    """What makes rows one sampler's sweep: the decoding fields set (except ``free`` ones, whatever their
    value) and the values of those that are not numbers (a choice, a text, a list).

    Example:
        >>> family_key({"strategy": "x", "min_p": 0.1, "temperature": 0.7}, free=("temperature",))
        (('min_p', None),)
    """
    key = []
    for name, value in row.items():
        field = BY_NAME.get(name)
        if field is None or value is None or name in free:
            continue
        shown = None if field.kind in NUMBERS else (tuple(value) if isinstance(value, list) else value)
        key.append((name, shown))
    return tuple(sorted(key, key=lambda item: item[0]))


def family_name(key: tuple) -> str:
    """A sampler's name from its key: the fields it sets (``min_p``; ``temperature only``).

    Example:
        >>> family_name((("xtc_probability", None), ("xtc_threshold", None)))
        'xtc_probability + xtc_threshold'
    """
    parts = [name if shown is None else f"{name}={shown}" for name, shown in key]
    return " + ".join(parts) if parts else "temperature only"


def is_sampling(row: dict[str, Any]) -> bool:
    """Whether a report row sampled (greedy and beam search rows have no diversity to tune).

    Example:
        >>> is_sampling({"strategy": "a", "min_p": 0.1}), is_sampling({"strategy": "b", "num_beams": 4})
        (True, False)
    """
    fields = [BY_NAME[name] for name, value in row.items() if name in BY_NAME and value is not None]
    return any(field.family == "sampling" for field in fields)


def matched_at_diversity(
    rows: Sequence[dict[str, Any]], target: float, metric: str = "distinct_2", quality: str = "perplexity"
) -> list[dict[str, Any]]:
    """For each sampler of the report, the row of its sweep whose ``metric`` is nearest ``target``, best
    ``quality`` (lowest) first. Each entry carries the row's values and 95% intervals, how many rows the
    sampler had (``candidates``), the distance to the target, whether the target lies within the
    sampler's swept range (``within``: else the nearest row is at an end of its sweep), whether it is compared
    at the target at all (``compared``: the target lies within its sweep or within its row's 95% interval of
    ``metric``; a sampler whose every row is far more or less diverse is not at the matched diversity), and the
    compared samplers it is clearly better than (``clear_of``, for a compared sampler: their quality interval lies
    wholly above its own).

    Example:
        >>> rows = [{"strategy": "a", "top_p": 0.9, "distinct_2": 0.8, "distinct_2_low": 0.78,
        ...          "distinct_2_high": 0.82, "perplexity": 10.0, "perplexity_low": 9.0, "perplexity_high": 11.0},
        ...         {"strategy": "b", "min_p": 0.1, "distinct_2": 0.79, "distinct_2_low": 0.77,
        ...          "distinct_2_high": 0.81, "perplexity": 14.0, "perplexity_low": 12.0, "perplexity_high": 16.0}]
        >>> [(m["strategy"], m["clear_of"]) for m in matched_at_diversity(rows, 0.8)]
        [('a', ['min_p']), ('b', [])]
    """
    families: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        if is_sampling(row) and row.get(metric) is not None and row.get(quality) is not None:
            families.setdefault(family_key(row, free=("temperature",)), []).append(row)
    matched = []
    for key, members in families.items():
        values = [row[metric] for row in members]
        best = min(members, key=lambda row: abs(row[metric] - target))
        matched.append({
            "sampler": family_name(key), "strategy": best["strategy"], "candidates": len(members),
            "target": target, "gap": abs(best[metric] - target), "within": min(values) <= target <= max(values),
            **{name: best.get(name) for name in (metric, f"{metric}_low", f"{metric}_high",
                                                 quality, f"{quality}_low", f"{quality}_high")},
        })  # fmt: skip
    matched.sort(key=lambda entry: entry[quality])
    for entry in matched:
        low, high = entry.get(f"{metric}_low"), entry.get(f"{metric}_high")
        entry["compared"] = entry["within"] or (low is not None and high is not None and low <= target <= high)
    for entry in matched:
        high = entry.get(f"{quality}_high")
        entry["clear_of"] = [
            other["sampler"] for other in matched
            if entry["compared"] and other["compared"] and high is not None
            and other.get(f"{quality}_low") is not None and other[f"{quality}_low"] > high
        ]  # fmt: skip
    return matched


def with_interval(row: dict[str, Any], metric: str, spec: str) -> str:
    """``0.875 [0.861, 0.890]``: a metric with its 95% interval (n/a when it could not be computed).

    Example:
        >>> with_interval({"ppl": 9.0, "ppl_low": 8.5, "ppl_high": 9.6}, "ppl", ".2f")
        '9.00 [8.50, 9.60]'
    """
    value, low, high = row.get(metric), row.get(f"{metric}_low"), row.get(f"{metric}_high")
    if value is None:
        return "n/a"
    return f"{value:{spec}}" + (f" [{low:{spec}}, {high:{spec}}]" if low is not None and high is not None else "")


def matched_lines(matched: Sequence[dict[str, Any]], target: float) -> list[str]:
    """``matched_at_diversity``'s entries as ``decodekit eval`` prints them: a heading, then a line per sampler
    with its row, distinct-2 and perplexity with intervals, whether the target lies outside its sweep (and is not
    compared), and the samplers it is clear of."""
    lines = [f"at matched diversity (each sampler's row nearest distinct-2 = {target:g}):"]
    for entry in matched:
        outside = "" if entry["within"] else "  (target outside its sweep)"
        if not entry.get("compared", True):
            outside = "  (target outside its sweep and its interval: not compared)"
        clear = f"  clear of: {', '.join(entry['clear_of'])}" if entry["clear_of"] else ""
        lines.append(f"  {entry['sampler']:24s} {entry['strategy']:32s} distinct-2 "
                     f"{with_interval(entry, 'distinct_2', '.3f')}  perplexity "
                     f"{with_interval(entry, 'perplexity', '.2f')}{outside}{clear}")  # fmt: skip
    return lines
