"""The cache benchmark's host-bound and GPU modes still run on the CPU (tiny configurations; their figures are
not asserted here)."""

from __future__ import annotations

import subprocess
import sys

from tests.benchmark_runs import BENCHMARKS, run_benchmark


def test_kv_cache_benchmark_host_bound_mode_runs():
    out = run_benchmark("kv_cache.py", "--host-bound", "--host-prompt", "64", "--host-tokens", "4",
                        "--host-rounds", "1", "--no-host-compile")  # fmt: skip
    assert "CompressedCache / DynamicCache tokens/s, host-bound" in out and "kv_bits=4" in out
    assert "memory_fraction=0.25, reconstruction" in out


def test_kv_cache_benchmark_gpu_mode_runs_on_cpu_with_a_tiny_shape():
    tiny = ["--shape", "tiny", "--lengths", "256,512", "--gpu-tokens", "4", "--device", "cpu"]
    out = run_benchmark("kv_cache.py", *tiny)
    assert "CompressedCache observation_window=64" in out and "DynamicCache" in out
    assert "CompressedCache eviction_interval=8" in out and "compiled decoding" not in out  # none asked on a CPU
    assert "CompressedCache bytes 0.25, replay pass" in out


def test_kv_cache_benchmark_gpu_mode_compiled_section_runs_on_cpu():
    out = run_benchmark("kv_cache.py", "--shape", "tiny", "--lengths", "256", "--gpu-tokens", "4", "--gpu-rounds", "1",
               "--device", "cpu", "--no-gpu-eager", "--gpu-compile-modes", "default")  # fmt: skip
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("256 ")]
    assert [(row[1], row[-4]) for row in rows] == [
        ("StaticCache", "eager"), ("StaticCache", "default"), ("CompressedCache(budget=64,", "eager"),
        ("CompressedCache(budget=64,", "default"), ("CompressedCache(budget=64),", "eager"),
        ("CompressedCache(budget=64),", "default"), ("CompressedCache(budget=64,", "eager"),
        ("CompressedCache(budget=64,", "default"),
    ]  # fmt: skip
    assert "eviction_interval=1)" in out and "default interval" in out and "eviction_interval=1, kv_bits=4)" in out
    assert "failed" not in out


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
    assert out.count(" operators ") == 3  # DynamicCache, the default and the byte-sized cache, profiled


def test_kv_step_profile_names_an_unknown_cache():
    import subprocess
    import sys

    from tests.benchmark_runs import BENCHMARKS

    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "kv_step_profile.py"), "--caches", "StaticCache"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode != 0 and "--caches: unknown ['StaticCache']" in result.stderr
