"""Your own grid: recipe files, sweeps, presets, samplers matched at equal diversity, and plots of any grid."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from decodekit import Strategy
from decodekit import models as models_module
from decodekit.cli import main
from decodekit.eval.grids import (
    parse_sweep,
    presets,
    read_rows,
    read_strategies,
    strategies_from_rows,
    sweep_strategies,
)
from decodekit.eval.matching import matched_at_diversity
from decodekit.eval.reports import (
    frontier_figure,
    matched_figure,
    read_report,
    temperature_figure,
    write_reports,
)
from decodekit.eval.runner import EvaluationReport, evaluate_strategies

SHORT = ["--limit", "2", "--max-new-tokens", "3", "--batch-size", "2", "--context-tokens", "48"]
SHORT += ["--continuation-tokens", "8", "--resamples", "4"]


def _write_grid(folder: Path, suffix: str, rows: list[dict]) -> Path:
    """The rows in one of the four formats, one row per line (after a header line where the format has one)."""
    path = folder / f"grid{suffix}"
    if suffix == ".json":
        path.write_text("[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n")
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif suffix == ".yaml":
        path.write_text("# my grid\n" + "".join(f"- {json.dumps(row)}\n" for row in rows))
    else:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        lines = [",".join(columns)] + [",".join(str(row.get(column, "")) for column in columns) for row in rows]
        path.write_text("\n".join(lines) + "\n")
    return path


# The line of row N: JSON's rows start after "[", YAML's after a comment, CSV's after its header.
FIRST_LINE = {".json": 2, ".jsonl": 1, ".yaml": 2, ".csv": 2}


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".yaml", ".csv"])
def test_each_format_reads_its_rows_with_their_lines(tmp_path, suffix):
    rows = [{"label": "a", "min_p": 0.05, "temperature": 0.7}, {"label": "b", "preset": "min-k", "temperature": 1.5}]
    strategies = read_strategies(_write_grid(tmp_path, suffix, rows))
    assert [s.to_dict() for s in strategies] == [
        {"name": "a", "temperature": 0.7, "min_p": 0.05},
        {"name": "b", "temperature": 1.5, "min_k": 1.0},
    ]
    _, wheres = read_rows(tmp_path / f"grid{suffix}")
    first = FIRST_LINE[suffix]
    assert wheres == [f"row 1 (line {first})", f"row 2 (line {first + 1})"]


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".yaml", ".csv"])
def test_a_fifty_row_grid_with_one_bad_row_is_refused_before_the_model_loads(tmp_path, suffix, capsys, monkeypatch):
    rows = [{"label": f"min-p {n}", "min_p": round(0.01 * n, 2), "temperature": 1.0} for n in range(1, 51)]
    rows[36]["top_p"] = 1.5  # row 37
    path = _write_grid(tmp_path, suffix, rows)

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the grid was checked")

    monkeypatch.setattr(models_module, "load_model", no_model)
    code = main(["eval", "--strategies", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    line = FIRST_LINE[suffix] + 36
    assert code == 2 and "Traceback" not in err
    assert f"row 37 (line {line}): top_p must be" in err and "in (0, 1]" in err and "got 1.5" in err


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"label": "x", "top_q": 0.9}, "unknown field 'top_q' (did you mean top_p?)"),
        ({"label": "x", "preset": "min-q"}, "unknown preset 'min-q'; presets: greedy, top-p 0.9"),
        ({"label": "x", "num_beams": 4, "min_p": 0.1}, "num_beams selects beam search, which does not sample"),
        ({"label": "", "min_p": 0.1}, "label must be a non-empty string"),
        ({"label": "x", "min_p": "lots"}, "min_p expected a number, got 'lots'"),
        ([0.1, 0.2], "expected a mapping of fields"),
    ],
)
def test_a_bad_row_is_named_with_what_its_field_accepts(row, message):
    with pytest.raises(ValueError, match=r"^row 2: ") as error:
        strategies_from_rows([{"label": "fine", "top_p": 0.9}, row])
    assert message in str(error.value)


def test_repeated_labels_empty_files_and_bad_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="row 2: label 'a' is row 1's too"):
        strategies_from_rows([{"label": "a"}, {"label": "a", "top_p": 0.9}])
    with pytest.raises(ValueError, match=re.escape("row 2: label 'sample(min_p=0.1)' is row 1's too")):
        strategies_from_rows([{"min_p": 0.1}, {"min_p": 0.1}])  # labelled by their fields alike
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        read_strategies(tmp_path / "empty.jsonl")
    (tmp_path / "grid.toml").write_text("")
    with pytest.raises(ValueError, match=re.escape("must end in .json, .jsonl, .yaml, .yml, .csv")):
        read_strategies(tmp_path / "grid.toml")
    (tmp_path / "broken.json").write_text('[\n{"label": "a"},\n{"label": }\n]')
    with pytest.raises(ValueError, match="line 3: Expecting value"):
        read_strategies(tmp_path / "broken.json")
    (tmp_path / "broken.yaml").write_text("- {label: a}\n- {label: b\n")
    with pytest.raises(ValueError, match=re.escape("broken.yaml: line 3")):
        read_strategies(tmp_path / "broken.yaml")
    with pytest.raises(ValueError, match="cannot read it"):
        read_strategies(tmp_path / "missing.csv")


def test_a_preset_gives_its_fields_and_a_row_overrides_them():
    assert presets()["min-p 0.1"] == {"min_p": 0.1} and presets()["greedy"] == {}
    named, overridden, relabelled = strategies_from_rows([
        {"preset": "top-p 0.9"}, {"preset": "top-p 0.9", "top_p": 0.8, "temperature": 0.7},
        {"label": "mine", "preset": "beam 4, gnmt", "length_alpha": 0.8},
    ])  # fmt: skip
    assert named == Strategy(name="top-p 0.9", top_p=0.9)
    assert overridden == Strategy(temperature=0.7, top_p=0.8)  # labelled by its fields: no longer the preset
    assert relabelled.to_dict() == {"name": "mine", "num_beams": 4, "length_normalization": "gnmt", "length_alpha": 0.8}


def test_csv_cells_are_read_as_the_flags_read_them(tmp_path):
    path = tmp_path / "grid.csv"
    path.write_text(
        'label,temperature,top_k,staged_penalty,early_stopping,num_beams,dry_multiplier,dry_sequence_breakers\n'
        'a,0.7,0,"1:1.2,3:1.5",,,0.8,"[""\\n""]"\nb,,,,never,4,,\n'
    )  # fmt: skip
    first, second = read_strategies(path)
    assert first.to_dict() == {"name": "a", "temperature": 0.7, "staged_penalty": "1:1.2,3:1.5",
                               "dry_multiplier": 0.8, "dry_sequence_breakers": ["\n"]}  # fmt: skip
    assert second.to_dict() == {"name": "b", "num_beams": 4, "early_stopping": "never"}


def test_sweeps_cross_every_value_with_the_base_recipe():
    grid = sweep_strategies([{"top_k": 0}], [parse_sweep("min_p=0.02,0.05,0.1"), parse_sweep("temperature=0.7,1,1.5")])
    assert [(s.min_p, s.temperature) for s in grid] == [(p, t) for p in (0.02, 0.05, 0.1) for t in (0.7, 1.0, 1.5)]
    assert all(s.top_k is None and s.sampling for s in grid)
    named = sweep_strategies([{"label": "mine", "top_p": 0.9, "temperature": 1.0}], [parse_sweep("temperature=0.7")])
    assert named == [Strategy(name="mine, temperature=0.7", top_p=0.9, temperature=0.7)]
    assert parse_sweep("staged-penalty=1:1.2,3:1.5;1:1.5") == ("staged_penalty", ("1:1.2,3:1.5", "1:1.5"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("min_p", "write FIELD=V1,V2"),
        ("top_q=0.9", "unknown field 'top_q' (did you mean top_p?)"),
        ("min_p=0.1,1.5", "min_p must be in [0, 1]; got 1.5"),
        ("min_p=0.1,0.1", "min_p has a value twice"),
        ("dry_sequence_breakers=a", "cannot be swept"),
    ],
)
def test_bad_sweeps_are_named(text, message):
    with pytest.raises(ValueError) as error:
        parse_sweep(text)
    assert message in str(error.value) and str(error.value).startswith(f"--sweep {text}: ")


def test_a_sweep_row_that_the_base_cannot_take_is_named():
    with pytest.raises(ValueError, match=re.escape("--sweep min_p=0.1 on beam: num_beams selects beam search")):
        sweep_strategies([{"label": "beam", "num_beams": 4}], [parse_sweep("min_p=0.1")])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--grid", "samplers", "--sweep", "min_p=0.1"], "--grid runs a built-in grid"),
        (["--min-p", "0.1", "--sweep", "min_p=0.05,0.1"], "--min-p and --sweep min_p=... both set min_p"),
        (["--sweep", "min_p=x"], "argument --sweep: min_p expected a number, got 'x'"),
        (["--num-beams", "2", "--sweep", "temperature=0.7"], "--sweep temperature=0.7: num_beams selects beam search"),
        (["--match-diversity", "2"], "--match-diversity: must be in [0, 1]"),
        (["--top-k", "-1"], "--top-k: must be >= 1 (or 0: off); got -1"),
    ],
)
def test_bad_grid_flags_get_one_line(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(models_module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    try:
        code = main(["eval", *argv, "--out", str(tmp_path / "out")])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code != 0 and message in err and "Traceback" not in err


def test_a_three_by_three_sweep_runs_as_one_grid_with_one_model_load(tiny_model_dir, tmp_path, capsys, monkeypatch):
    loads = []
    real_load = models_module.load_model

    def counting_load(*args, **kwargs):
        loads.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(models_module, "load_model", counting_load)
    out = tmp_path / "out"
    argv = ["eval", "--model", str(tiny_model_dir), "--sweep", "min_p=0.02,0.05,0.1", "--sweep",
            "temperature=0.7,1.0,1.5", "--top-k", "0", "--match-diversity", "0.5", "--out", str(out),
            *SHORT]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert len(loads) == 1
    assert [(row["min_p"], row["temperature"]) for row in report["strategies"]] == [
        (p, t) for p in (0.02, 0.05, 0.1) for t in (0.7, 1.0, 1.5)
    ]
    assert report["strategies"][0]["strategy"] == "sample(temperature=0.7, min_p=0.02)"
    (matched,) = report["matched"]  # one sampler, min-p, tuned over its nine rows
    assert matched["sampler"] == "min_p" and matched["candidates"] == 9
    nearest = min(report["strategies"], key=lambda row: abs(row["distinct_2"] - 0.5))
    assert matched["strategy"] == nearest["strategy"] and "at matched diversity" in printed
    assert (out / "matched.png").read_bytes()[:4] == b"\x89PNG"


def test_evaluate_strategies_takes_rows_and_grid_files(tiny, tmp_path):
    model, tokenizer = tiny
    rows = [{"label": "cool", "preset": "min-p 0.1", "temperature": 0.7}, {"label": "greedy", "preset": "greedy"}]
    path = _write_grid(tmp_path, ".jsonl", rows)
    settings = {"max_new_tokens": 3, "batch_size": 2, "context_tokens": 48, "continuation_tokens": 8,
                "compression_ratios": (0.0,), "memory_fractions": (), "resamples": 4, "progress": False}  # fmt: skip
    from_rows = evaluate_strategies(model, tokenizer, ["Hi", "Hello"], rows, **settings)
    from_file = evaluate_strategies(model, tokenizer, ["Hi", "Hello"], str(path), **settings)
    from_strategies = evaluate_strategies(
        model, tokenizer, ["Hi", "Hello"], [Strategy(name="cool", min_p=0.1, temperature=0.7), Strategy(name="greedy")],
        **settings,
    )  # fmt: skip
    assert [row["strategy"] for row in from_rows.strategies] == ["cool", "greedy"]
    assert from_rows.generations == from_file.generations == from_strategies.generations
    with pytest.raises(ValueError, match="row 2: unknown field 'min_q'"):
        evaluate_strategies(model, tokenizer, ["Hi"], [{"label": "a"}, {"min_q": 0.1}], **settings)


def _row(label, distinct, perplexity, spread=0.5, **fields):
    return {"strategy": label, **fields, "distinct_2": distinct, "distinct_2_low": distinct - 0.01,
            "distinct_2_high": distinct + 0.01, "perplexity": perplexity, "perplexity_low": perplexity - spread,
            "perplexity_high": perplexity + spread}  # fmt: skip


def test_each_sampler_is_matched_at_its_row_nearest_the_target_by_hand():
    rows = [
        _row("greedy", 0.60, 3.0),  # does not sample: no diversity to tune
        _row("min-p 0.2", 0.70, 6.0, min_p=0.2, temperature=1.0),
        _row("min-p 0.1", 0.78, 9.0, min_p=0.1, temperature=1.0),
        _row("min-p 0.1 hot", 0.86, 15.0, min_p=0.1, temperature=1.5),
        _row("top-p 0.8", 0.79, 12.0, top_p=0.8, temperature=1.0),
        _row("top-p 0.9", 0.84, 16.0, top_p=0.9, temperature=1.0),
        _row("XTC", 0.95, 40.0, xtc_threshold=0.1, xtc_probability=0.5, temperature=1.0),
        _row("beam", 0.5, 2.0, num_beams=4, length_normalization="gnmt"),
    ]
    matched = {entry["sampler"]: entry for entry in matched_at_diversity(rows, 0.8)}
    assert set(matched) == {"min_p", "top_p", "xtc_probability + xtc_threshold"}
    # |0.78 - 0.8| = 0.02 < |0.86 - 0.8| = 0.06 < |0.70 - 0.8|; top-p: |0.79 - 0.8| beats |0.84 - 0.8|.
    assert (matched["min_p"]["strategy"], matched["min_p"]["candidates"]) == ("min-p 0.1", 3)
    assert matched["min_p"]["gap"] == pytest.approx(0.02) and matched["min_p"]["within"]
    assert matched["top_p"]["strategy"] == "top-p 0.8" and matched["top_p"]["within"]
    assert matched["xtc_probability + xtc_threshold"]["within"] is False  # 0.8 lies below its one row
    # ... and outside that row's interval [0.94, 0.96]: XTC is not at the matched diversity, and not compared.
    assert [entry["compared"] for entry in matched.values()] == [True, True, False]
    # Quality compared there: min-p 9 +- 0.5 against top-p 12 +- 0.5: clear of it; XTC is in nobody's list.
    assert next(entry["sampler"] for entry in matched_at_diversity(rows, 0.8)) == "min_p"
    assert matched["min_p"]["clear_of"] == ["top_p"]
    assert matched["top_p"]["clear_of"] == [] and matched["xtc_probability + xtc_threshold"]["clear_of"] == []
    # A sampler outside its sweep whose row's interval holds the target is compared: XTC at 0.81 [0.80, 0.82].
    near = [*rows[:-2], _row("XTC", 0.81, 40.0, xtc_threshold=0.1, xtc_probability=0.5, temperature=1.0)]
    entries = {entry["sampler"]: entry for entry in matched_at_diversity(near, 0.8)}
    assert entries["xtc_probability + xtc_threshold"]["within"] is False
    assert entries["xtc_probability + xtc_threshold"]["compared"]
    assert entries["min_p"]["clear_of"] == ["top_p", "xtc_probability + xtc_threshold"]
    # With wide intervals nobody is clear of anybody.
    wide = [_row(r["strategy"], r["distinct_2"], r["perplexity"], spread=30, **{k: v for k, v in r.items()
            if k not in ("strategy",) and not k.startswith(("distinct", "perplexity"))}) for r in rows]  # fmt: skip
    assert all(entry["clear_of"] == [] for entry in matched_at_diversity(wide, 0.8))


def _sweep_report() -> EvaluationReport:
    rows = [_row(f"sample(temperature={t:g}, min_p={p:g})", 0.6 + t / 5 - p, 3 + 4 * t - 10 * p, min_p=p,
                 temperature=t) for p in (0.02, 0.1) for t in (0.7, 1.0, 1.5)]  # fmt: skip
    rows += [_row(f"min-k, T={t:g}", 0.55 + t / 6, 2 + 2 * t, min_k=1.0, temperature=t) for t in (1.0, 1.5)]
    rows.append(_row("min-k 0.5, T=1", 0.75, 5.0, min_k=0.5, temperature=1.0))
    rows.append(_row("greedy", 0.5, 2.5))
    report = EvaluationReport(strategies=rows, settings={"match_diversity": 0.8})
    report.matched = matched_at_diversity(rows, 0.8)
    return report


def test_the_plots_draw_any_grid():
    report = _sweep_report()
    frontier = frontier_figure(report).axes[0]
    legend = [text.get_text() for text in frontier.get_legend().get_texts()]
    assert legend == ["min_p swept", "min_k swept", "greedy"]  # a line per sweep, named by what it sweeps
    lines = {line.get_label(): len(line.get_xdata()) for line in frontier.get_lines()}
    assert lines["min_p swept"] == 6 and lines["min_k swept"] == 3
    assert "min_p=0.02, T=0.7" in [text.get_text() for text in frontier.texts]
    top = temperature_figure(report).axes[0]
    lines = [line for line in top.get_lines() if not line.get_label().startswith("_")]
    drawn = {line.get_label(): list(line.get_xdata()) for line in lines}
    assert drawn == {"min_p=0.02": [0.7, 1.0, 1.5], "min_p=0.1": [0.7, 1.0, 1.5], "min-k": [1.0, 1.5]}
    matched = matched_figure(report).axes[0]
    assert [tick.get_text() for tick in matched.get_yticklabels()] == [e["sampler"] for e in report.matched]
    assert "0.8" in matched.get_title()


def test_the_plots_show_the_grids_own_labels():
    """Rows a grid file labelled each on its own (one sweep of min_p: "cautious", "balanced", "wild") carry their
    labels on their points, and a labelled recipe swept over temperatures (``--sweep temperature=...`` of a row
    labelled "mine": "mine, temperature=0.7", ...) is one line named "mine" in both plots."""
    rows = [_row(label, 0.6 + p, 3 + 10 * p, name=label, min_p=p, temperature=1.0)
            for label, p in (("cautious", 0.2), ("balanced", 0.1), ("wild", 0.02))]  # fmt: skip
    rows += [_row(f"mine, temperature={t:g}", 0.5 + t / 5, 2 + 3 * t, top_p=0.9, temperature=t)
             for t in (0.7, 1.0, 1.5)]  # fmt: skip
    report = EvaluationReport(strategies=rows)
    frontier = frontier_figure(report).axes[0]
    texts = [text.get_text() for text in frontier.texts]
    assert {"cautious (min_p=0.2)", "balanced (min_p=0.1)", "wild (min_p=0.02)"} <= set(texts)
    assert "mine" in [text.get_text() for text in frontier.get_legend().get_texts()]
    assert {"T=0.7", "T=1", "T=1.5"} <= set(texts)  # (the named sweep's points: what varies along it)
    top = temperature_figure(report).axes[0]
    assert [line.get_label() for line in top.get_lines() if not line.get_label().startswith("_")] == ["mine"]


def test_matched_png_is_written_with_a_matched_report_and_removed_without_one(tmp_path):
    report = _sweep_report()
    paths = write_reports(report, tmp_path)
    assert paths["matched.png"].exists() and read_report(tmp_path).matched == report.matched
    again = read_report(tmp_path / "report.json")
    again.matched = []
    assert "matched.png" not in write_reports(again, tmp_path) and not (tmp_path / "matched.png").exists()
    with pytest.raises(ValueError, match=re.escape("not a readable report.json")):
        read_report(tmp_path / "missing.json")
