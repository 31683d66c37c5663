"""The evaluation runner, its data sources, its reports, the CLI, and two processes against one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

from decodekit import Strategy, generate_text
from decodekit.cache import CompressedCache
from decodekit.cache.size import full_cache_bytes
from decodekit.cli import main
from decodekit.eval import distinct_n, self_bleu
from decodekit.eval.data_sources import load_prompts, load_reference
from decodekit.eval.perplexity import continuation_perplexity, perplexity
from decodekit.eval.reports import write_reports
from decodekit.eval.runner import MEMORY_FRACTIONS, evaluate_strategies

SHORT = {"max_new_tokens": 8, "batch_size": 2, "context_tokens": 96, "continuation_tokens": 24, "progress": False}


def test_prompts_load_from_json_csv_and_text_files(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    (tmp_path / "p.csv").write_text("question,id\nwhat?,1\nwhy?,2\n")
    (tmp_path / "p.txt").write_text("first line\n\nsecond line\n")
    assert load_prompts(tmp_path / "p.jsonl") == ["a", "b"]
    assert load_prompts(tmp_path / "p.csv", "question") == ["what?", "why?"]
    assert load_prompts(tmp_path / "p.txt") == ["first line", "second line"]
    with pytest.raises(ValueError, match="no column 'prompt'; its columns: question, id"):
        load_prompts(tmp_path / "p.csv")
    with pytest.raises(ValueError, match="prompts file not found"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "p.bak").write_text("x")
    with pytest.raises(ValueError, match="must end in"):
        load_prompts(tmp_path / "p.bak")
    assert load_prompts()[0].startswith("Write a short story")
    assert "__init__" in load_reference()


def test_the_report_holds_what_the_pieces_compute_on_their_own(tiny):
    model, tokenizer = tiny
    prompts = load_prompts()[:4]
    strategies = [Strategy(name="greedy"), Strategy(name="hot", temperature=1.3)]
    report = evaluate_strategies(model, tokenizer, prompts, strategies, seed=7, compression_ratios=(0.0, 0.5), **SHORT)
    # Oracle: the same generations prompt by prompt with the documented per-prompt seeds.
    for index, strategy in enumerate(strategies):
        expected = []
        for prompt_index, prompt in enumerate(prompts):
            seeds = [7 + 100_003 * index + prompt_index]
            expected += generate_text(model, tokenizer, [prompt], strategy, max_new_tokens=8, row_seeds=seeds)
        assert report.generations[strategy.label] == expected
        row = report.strategies[index]
        assert row["distinct_2"] == distinct_n(expected, 2)
        assert row["self_bleu"] == self_bleu(expected)
        scorable = [text for text in expected if tokenizer(text, add_special_tokens=False)["input_ids"]]
        assert row["perplexity"] == pytest.approx(perplexity(scorable, model, tokenizer).corpus_perplexity)
        assert 0.0 < row["mauve"] <= 1.0
    ids = tokenizer(load_reference(), add_special_tokens=False)["input_ids"][:120]
    full = continuation_perplexity(model, DynamicCache(), torch.tensor([ids[:96]]), torch.tensor([ids[96:]]))
    full16 = full_cache_bytes(model, 120, element_size=2)
    assert report.compression[0] == {
        "compression_ratio": 0.0, "memory_fraction": None, "memory": 2.0, "perplexity": pytest.approx(full)
    }  # fmt: skip
    # Oracle for the byte-sized rows: the same cache built by hand, and its bytes against the size asked.
    for row, fraction in zip(report.compression[2:], MEMORY_FRACTIONS, strict=True):
        kv_bits, key_bits = (4, 8) if fraction >= 0.45 else (4, 4)  # the widths documented for each size (attention)
        cache = CompressedCache(model, memory_fraction=fraction, kv_bits=kv_bits, key_bits=key_bits)
        value = continuation_perplexity(model, cache, torch.tensor([ids[:96]]), torch.tensor([ids[96:]]))
        assert row["memory_fraction"] == fraction and row["perplexity"] == pytest.approx(value)
        assert row["memory"] == cache.memory_bytes() / full16


def test_the_report_does_not_depend_on_the_batch_size(tiny):
    model, tokenizer = tiny
    prompts = load_prompts()[:5]
    strategies = [
        Strategy(name="greedy"),
        Strategy(name="min-p", temperature=1.0, min_p=0.1),
        Strategy(name="top-p", temperature=1.3, top_p=0.9, staged_penalty="1:1.3,3:2.0"),
        Strategy(name="beam", num_beams=3, length_normalization="gnmt", length_alpha=0.6),
        Strategy(name="kv", kv_budget=40),
    ]
    settings = {**SHORT, "context_tokens": 64, "continuation_tokens": 16}
    reports = {
        size: evaluate_strategies(
            model, tokenizer, prompts, strategies, compression_ratios=(0.0,), **{**settings, "batch_size": size}
        )
        for size in (1, 3)
    }
    assert reports[1].generations == reports[3].generations
    assert reports[1].strategies == reports[3].strategies
    assert reports[1].compression == reports[3].compression


def test_reports_are_written_as_json_csv_and_png(tiny, tmp_path):
    model, tokenizer = tiny
    strategies = [Strategy(name="greedy"), Strategy(temperature=0.7, top_p=0.9), Strategy(temperature=0.7, min_p=0.1)]
    report = evaluate_strategies(
        model, tokenizer, load_prompts()[:2], strategies, compression_ratios=(0.0, 0.5), **SHORT
    )
    paths = write_reports(report, tmp_path / "out")
    data = json.loads(paths["report.json"].read_text())
    assert [row["strategy"] for row in data["strategies"]] == [s.label for s in strategies]
    assert paths["report.csv"].read_text().splitlines()[0].startswith("strategy,")
    for name in ("frontier.png", "temperature.png", "compression.png"):
        assert paths[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cli_runs_on_two_processes_as_on_one(tiny_model_dir, tmp_path):
    flags = ["--model", str(tiny_model_dir), "--limit", "4", "--batch-size", "1", "--max-new-tokens", "6"]
    flags += ["--context-tokens", "64", "--continuation-tokens", "16"]
    runs = {
        "one": [sys.executable, "-m", "decodekit.eval"],
        "two": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "decodekit.eval"],
    }
    reports = {}
    for name, command in runs.items():
        result = subprocess.run(
            [*command, *flags, "--out", str(tmp_path / name)], capture_output=True, text=True, timeout=300, check=False
        )
        assert result.returncode == 0, result.stderr[-2000:]
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())
    assert (reports["one"]["settings"].pop("processes"), reports["two"]["settings"].pop("processes")) == (1, 2)
    for report in reports.values():  # wall times differ from run to run
        assert set(report["settings"].pop("seconds")) == {"generation", "perplexity", "mauve", "intervals",
                                                           "compression"}  # fmt: skip
    assert reports["one"] == reports["two"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["eval", "--prompts", "no/such/file.jsonl"], "prompts file not found"),
        (["eval", "--limit", "0"], "--limit: must be >= 1"),
        (["eval", "--seeds", "0"], "--seeds: must be >= 1"),
        (["eval", "--resamples", "1"], "--resamples: must be >= 2"),
        (["eval", "--grid", "samplers", "--temperatures", "0.7,x"], "--temperatures: must be comma-separated"),
        (["eval", "--grid", "samplers", "--temperatures", "nan"], "each temperature must be in"),
    ],
)
def test_bad_eval_input_gets_one_line(capsys, argv, message):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code != 0 and message in err and "Traceback" not in err


def test_seeds_average_per_seed_metrics_and_give_intervals_over_prompts_and_seeds(tiny):
    """Oracle: the generations rebuilt with the documented row seeds, each metric per seed by the plain
    functions, and the interval recomputed with numpy's percentiles over the same half-samples."""
    import numpy

    from decodekit.eval.intervals import half_samples
    from decodekit.eval.runner import SEED_STRIDE

    model, tokenizer = tiny
    prompts = load_prompts()[:6]
    strategies = [Strategy(name="greedy"), Strategy(name="hot", temperature=1.3)]
    report = evaluate_strategies(model, tokenizer, prompts, strategies, seed=7, seeds=3, resamples=50,
                                 compression_ratios=(0.0,), memory_fractions=(), **SHORT)  # fmt: skip
    greedy, hot = report.strategies
    assert (greedy["seeds"], hot["seeds"]) == (1, 3)
    assert len(report.generations["greedy"]) == 6 and len(report.generations["hot"]) == 18
    per_seed = []
    for seed_index in range(3):
        seeds = [7 + SEED_STRIDE * seed_index + 100_003 + row for row in range(6)]
        texts = [generate_text(model, tokenizer, [p], strategies[1], max_new_tokens=8, row_seeds=[s])[0]
                 for p, s in zip(prompts, seeds, strict=True)]  # fmt: skip
        per_seed.append(texts)
    assert report.generations["hot"] == [text for texts in per_seed for text in texts]
    assert len({tuple(texts) for texts in per_seed}) == 3  # the seeds differ
    assert hot["distinct_2"] == pytest.approx(numpy.mean([distinct_n(texts, 2) for texts in per_seed]))
    draws = half_samples(6, 3, 50, seed=7)
    values = numpy.array([numpy.mean([distinct_n([per_seed[k][p] for p in chosen], 2) for k in ks])
                          for chosen, ks in draws])  # fmt: skip
    deviations = values - values.mean()
    low, high = (min(max(hot["distinct_2"] + numpy.percentile(deviations, q), 0.0), 1.0) for q in (2.5, 97.5))
    assert (hot["distinct_2_low"], hot["distinct_2_high"]) == (pytest.approx(low), pytest.approx(high))
    for row in (greedy, hot):
        for name in ("distinct_2", "self_bleu", "perplexity", "rep_16"):
            assert row[f"{name}_low"] <= row[name] <= row[f"{name}_high"], (row["strategy"], name)
        assert row["mauve_low"] is None and row["mauve_high"] is None
    assert hot["distinct_2_high"] - hot["distinct_2_low"] > 0
