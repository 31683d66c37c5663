"""A report's samplers matched again at a diversity target, without generating anything again.

    python benchmarks/eval_rematch.py benchmarks/results/samplers_matched_cpu.csv --target 0.8 \
        --plot benchmarks/results/samplers_matched.png

Reads the rows of a ``report.csv`` (or a ``report.json``) that ``decodekit eval`` wrote, matches each sampler at the
row of its sweep nearest the target (``decodekit.eval.matching.matched_at_diversity``, as ``--match-diversity``
does) and prints the result as ``decodekit eval`` prints it; ``--plot`` draws ``matched.png`` from the same rows.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from decodekit.eval.matching import matched_at_diversity, matched_lines
from decodekit.eval.reports import EvaluationReport, matched_figure, read_report

TEXT_COLUMNS = ("strategy", "name", "length_normalization")


def read_rows(path: Path) -> list[dict]:
    """The strategy rows of a report.csv (numbers as floats, empty cells as None) or a report.json."""
    if path.suffix == ".json":
        return read_report(path).strategies
    with path.open(newline="") as handle:
        return [{key: None if value == "" else value if key in TEXT_COLUMNS else _number(value)
                 for key, value in row.items()} for row in csv.DictReader(handle)]  # fmt: skip


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="a report.csv or report.json written by decodekit eval")
    parser.add_argument("--target", type=float, default=0.8, help="the distinct-2 to match at (0.8)")
    parser.add_argument("--plot", type=Path, help="also draw matched.png at this path")
    args = parser.parse_args()
    rows = read_rows(args.report)
    matched = matched_at_diversity(rows, args.target)
    print("\n".join(matched_lines(matched, args.target)))
    if args.plot is not None:
        report = EvaluationReport(strategies=rows, settings={"match_diversity": args.target}, matched=matched)
        matched_figure(report).savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
