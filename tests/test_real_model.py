"""The embedded default model, end to end (marked slow: it loads SmolLM2-135M-Instruct)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from decodekit import Strategy, generate_text
from decodekit import models as models_module

pytestmark = pytest.mark.slow


def test_greedy_answer_is_sensible(real):
    model, tokenizer = real
    text = generate_text(model, tokenizer, ["What is the capital of France?"], Strategy(), max_new_tokens=16)[0]
    assert "Paris" in text


def test_cli_prints_a_sensible_continuation(real):
    result = subprocess.run(
        [sys.executable, "-m", "decodekit", "generate", "The capital of France is", "--max-new-tokens", "16"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_cached_copy_matches_the_gguf_and_reloads_fast(real, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    gguf = models_module.default_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name).eval()
    model, tokenizer = real
    ids = tokenizer("The quick brown fox", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    start = time.perf_counter()
    models_module.load_model()
    assert time.perf_counter() - start < 30  # generous: the reload reads safetensors, never the GGUF


def test_real_conversion_finds_a_corrupted_copy_and_rebuilds_it_logging_one_line(real, tmp_path, monkeypatch):
    """A copy corrupted since its conversion is found out and converted again; with stderr a pipe (a log file,
    CI), the conversion says what it does once, with no bars. (The copy is the session's own, so that the test
    pays for one conversion.)"""
    import shutil

    converted = models_module.converted_gguf_dir(models_module.default_gguf_path())  # the session's copy
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path))
    directory = tmp_path / converted.name
    shutil.copytree(converted, directory)
    assert models_module.converted_gguf_dir(models_module.default_gguf_path()) == directory  # found, not converted
    weights = directory / "model.safetensors"
    with weights.open("r+b") as handle:
        handle.seek(weights.stat().st_size // 2)
        handle.write(b"\x00\x01\x02\x03")
    assert not models_module.is_valid_converted_dir(directory)
    script = "from decodekit.models import converted_gguf_dir as c, default_gguf_path as p; c(p())"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)  # env inherited
    assert done.returncode == 0, done.stderr[-2000:]
    assert "\r" not in done.stderr and "%|" not in done.stderr, done.stderr[:500]
    assert [line for line in done.stderr.splitlines() if line.strip()] == [
        "decodekit: converting SmolLM2-135M-Instruct.Q4_1.gguf to safetensors (once; later loads reuse it)"
    ]
    assert models_module.is_valid_converted_dir(directory)  # rebuilt in place
    model, _ = models_module.load_model()
    assert model.config.num_hidden_layers == 30
