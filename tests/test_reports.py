"""The evaluation's plots read at a glance, and every report column is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from decodekit import Strategy
from decodekit.eval.reports import compression_figure, frontier_figure
from decodekit.eval.runner import EvaluationReport, evaluate_strategies
from decodekit.fields import BY_NAME

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
REPORT_COLUMNS = ROOT / "docs" / "eval-report.md"


def _report() -> EvaluationReport:
    rows = [{"strategy": "greedy", "distinct_2": 0.60, "perplexity": 3.0}]
    rows += [{"strategy": f"top-p T={t}", "top_p": 0.9, "temperature": t, "distinct_2": 0.6 + t / 5,
              "perplexity": 3 + 4 * t} for t in (0.7, 1.0, 1.3)]  # fmt: skip
    rows += [{"strategy": f"min-p T={t}", "min_p": 0.1, "temperature": t, "distinct_2": 0.6 + t / 6,
              "perplexity": 3 + 3 * t} for t in (0.7, 1.0, 1.3)]  # fmt: skip
    rows += [{"strategy": f"beam 4, {n}", "num_beams": 4, "distinct_2": 0.5, "perplexity": 2.0}
             for n in ("none", "average", "gnmt")]  # fmt: skip
    rows.append({"strategy": "greedy, kv budget 64", "kv_budget": 64, "distinct_2": 0.60, "perplexity": 3.0001})
    compression = [
        {"compression_ratio": r, "memory_fraction": None, "memory": 2 * (1 - r), "perplexity": 18.5 + r / 10}
        for r in (0.0, 0.25, 0.5, 0.75)
    ] + [
        {"compression_ratio": None, "memory_fraction": f, "memory": f * 0.95, "perplexity": 18.5 + (1 - f) / 20}
        for f in (0.5, 0.1)
    ]
    return EvaluationReport(strategies=rows, compression=compression)


def _legend(figure) -> list[str]:
    return [text.get_text() for text in figure.axes[0].get_legend().get_texts()]


def test_every_frontier_point_has_a_legend_entry_and_shared_points_share_one():
    figure = frontier_figure(_report())
    legend = _legend(figure)
    assert "top-p" in legend and "min-p" in legend
    assert "beam 4, none = beam 4, average = beam 4, gnmt" in legend  # one point, one entry, all three named
    assert "greedy" in legend and "greedy, kv budget 64" in legend  # near each other, each in the legend
    axes = figure.axes[0]
    assert axes.get_yscale() == "log" and "log scale" in axes.get_ylabel() and "lower" in axes.get_ylabel()
    assert "higher" in axes.get_xlabel()
    # Strategy names are no longer written beside points, where they overlapped.
    annotations = [child.get_text() for child in axes.texts]
    assert all(re.fullmatch(r"T=[0-9.]+", text) for text in annotations)


def test_the_compression_plot_marks_the_baseline_and_does_not_magnify_noise():
    figure = compression_figure(_report())
    axes = figure.axes[0]
    low, high = axes.get_ylim()
    assert low <= 18.5 * 0.95 and high >= 18.5 * 1.05  # a 0.4% spread stays a flat line
    assert any(text.startswith("full cache") for text in _legend(figure))
    # Each cache's change from the full cache, at the memory it held: evicting in float32, then sized in bytes.
    assert [child.get_text() for child in axes.texts] == ["+0.4%", "+0.3%", "+0.1%", "+0.2%", "+0.1%"]
    lines = {line.get_label(): list(line.get_xdata()) for line in axes.get_lines()}
    assert lines["evicting (compression_ratio)"] == [0.5, 1.0, 1.5]
    assert lines["sized in bytes (memory_fraction)"] == pytest.approx([0.095, 0.475])
    assert "16-bit" in axes.get_xlabel()


def test_the_docs_document_every_report_column(tiny):
    model, tokenizer = tiny
    report = evaluate_strategies(
        model, tokenizer, ["Hi", "Hello there"], [Strategy(name="greedy")], max_new_tokens=4, batch_size=2,
        context_tokens=64, continuation_tokens=8, compression_ratios=(0.0, 0.5), progress=False,
    )  # fmt: skip
    assert "(docs/eval-report.md)" in README.read_text()  # the README links the column table
    text = REPORT_COLUMNS.read_text()
    columns = {key for row in report.strategies for key in row} - set(BY_NAME)
    # An interval's bounds are documented by the one row `<metric>_low`, `<metric>_high` and their metric's.
    bounds = {column for column in columns if column.endswith(("_low", "_high"))}
    assert bounds and "`<metric>_low`, `<metric>_high`" in text
    assert {column.rsplit("_", 1)[0] for column in bounds} <= columns
    missing = sorted(column for column in columns - bounds if f"`{column}`" not in text)
    assert not missing, f"report columns missing from docs/eval-report.md: {missing}"
    assert set(report.settings["seconds"]) == {"generation", "perplexity", "mauve", "intervals", "compression"}


@pytest.mark.parametrize("figure_of", [frontier_figure, compression_figure])
def test_plots_survive_an_empty_report(figure_of):
    figure_of(EvaluationReport())
