"""The cache benchmark's host-bound and GPU modes still run on the CPU (tiny configurations; their figures are
not asserted here)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.benchmark_runs import BENCHMARKS, refused_benchmark, run_benchmark


def test_kv_cache_benchmark_host_bound_mode_runs():
    out = run_benchmark("kv_cache.py", "--host-bound", "--host-prompt", "64", "--host-tokens", "4",
                        "--host-rounds", "1", "--no-host-compile")  # fmt: skip
    assert "CompressedCache / DynamicCache tokens/s, host-bound" in out and "kv_bits=4" in out
    assert "memory_fraction=0.25, reconstruction" in out


def test_kv_cache_benchmark_gpu_mode_runs_on_cpu_with_a_tiny_shape():
    tiny = ["--shape", "tiny", "--lengths", "256,512", "--gpu-tokens", "4", "--device", "cpu", "--gpu-rounds", "1"]
    tiny += ["--gpu-decode-rounds", "1"]
    out = run_benchmark("kv_cache.py", *tiny)
    assert "CompressedCache observation_window=64" in out and "DynamicCache" in out
    assert "CompressedCache eviction_interval=8" in out and "compiled decoding" not in out  # none asked on a CPU
    assert "CompressedCache bytes 0.25, replay pass" in out
    ceiling = "MiB of ours: moving every byte at one rate, it decodes at most"
    assert out.count(ceiling) == 2  # one line under each length's targets


def test_kv_cache_benchmark_gpu_mode_compiled_section_runs_on_cpu():
    """The section's code, compiled by dynamo's eager backend (inductor compiling these steps is tested in
    tests/test_kv_compiled_steps.py; here it would add minutes of compiling on a machine with a cold cache)."""
    out = run_benchmark("kv_cache.py", "--shape", "tiny", "--lengths", "256", "--gpu-tokens", "4", "--gpu-rounds", "1",
               "--device", "cpu", "--no-gpu-eager", "--gpu-compile-modes", "default",
               "--gpu-compile-backend", "eager")  # fmt: skip
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("256 ")]
    assert [(row[1], row[-4]) for row in rows] == [
        ("StaticCache", "eager"), ("StaticCache", "backend=eager"), ("CompressedCache(budget=64,", "eager"),
        ("CompressedCache(budget=64,", "backend=eager"), ("CompressedCache(budget=64),", "eager"),
        ("CompressedCache(budget=64),", "backend=eager"), ("CompressedCache(budget=64,", "eager"),
        ("CompressedCache(budget=64,", "backend=eager"),
    ]  # fmt: skip
    assert "eviction_interval=1)" in out and "default interval" in out and "eviction_interval=1, kv_bits=4)" in out
    assert "failed" not in out


def test_kv_cache_benchmark_refuses_inductors_modes_with_another_backend():
    stderr = refused_benchmark("kv_cache.py", "--shape", "tiny", "--gpu-compile-backend", "eager",
                               "--gpu-compile-modes", "default,reduce-overhead")  # fmt: skip
    assert "--gpu-compile-modes: with --gpu-compile-backend eager only 'default'" in stderr


def test_kv_cache_benchmark_refuses_an_unknown_compiled_row():
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "kv_cache.py"), "--shape", "tiny", "--gpu-compiled-caches", "static,fast"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    rows = "static, interval1, default, interval1-4bit"
    assert f"--gpu-compiled-caches: unknown ['fast']; choose from {rows}" in result.stderr


def test_kv_step_profile_runs_and_counts_each_steps_operators():
    out = run_benchmark("kv_step_profile.py", "--shape", "tiny", "--lengths", "64", "--tokens", "2", "--rounds", "1")
    assert "memory_fraction=0.25" in out and "CompressedCache never evicting" in out
    assert len(re.findall(r"\d operators ", out)) == 3  # DynamicCache, the default and the byte-sized cache, profiled
    assert "operators per step, memory_fraction=0.25 / DynamicCache: " in out  # and the target's ratio


def test_kv_step_profile_names_an_unknown_cache():
    import subprocess
    import sys

    from tests.benchmark_runs import BENCHMARKS

    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "kv_step_profile.py"), "--caches", "StaticCache"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode != 0 and "--caches: unknown ['StaticCache']" in result.stderr


def test_the_memory_bound_ceiling_counts_each_weight_a_step_reads_once():
    sys.path.insert(0, str(BENCHMARKS))
    from kv_cache import memory_bound_ceiling, weight_bytes_read
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "vocab_size": 100}  # fmt: skip
    # By hand, float32: per layer q, k, v, o (16*16 + 16*8 + 16*8 + 16*16), the MLP (3 * 16*32) and two norms (2*16);
    # the final norm (16); the embedding (100*16), read whole by the tied output projection.
    per_layer = 16 * 16 + 16 * 8 + 16 * 8 + 16 * 16 + 3 * 16 * 32 + 2 * 16
    tied = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True))
    assert weight_bytes_read(tied) == 4 * (2 * per_layer + 16 + 100 * 16)
    # Untied: the output projection is read whole, the input embedding only a row per step (not counted).
    untied = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    assert weight_bytes_read(untied) == 4 * (2 * per_layer + 16 + 100 * 16)
    assert memory_bound_ceiling(2.0, 1.0, 0.25) == 3.0 / 2.25
    assert memory_bound_ceiling(2.0, 1.0, 1.0) == 1.0

