"""Shared fixtures: a tiny random model saved once per session, and the real default model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# Under pytest-xdist (make test) the workers share the cores instead of each taking all of them, and so do
# the processes a test starts (a benchmark script, the CLI): more threads than cores make every one of them
# wait on the others (a benchmark run took 3 minutes alone and nearly 10 beside another worker).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(share)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(share)

# Without CUDA, Triton kernels run in Triton's interpreter on the CPU (tests/test_cache_triton.py).
# Triton reads this once, when it is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny import save_tiny_model

# ``make test`` hands whole files to its workers (pytest-xdist's ``--dist loadfile``) in collection order
# (``--no-loadscope-reorder``; xdist would order them by their number of tests), so the slowest files are collected
# first, heaviest first: a long file started last would leave the other workers idle while it runs. Measured with
# ``--durations=0`` and an empty inductor cache (a fresh machine's); a file not named here follows in pytest's order.
SLOWEST_FILES = (
    "test_kv_compiled_steps.py",
    "test_batch_invariance.py",
    "test_benchmark_kv_cache.py",
    "test_benchmark_kv_modes.py",
    "test_benchmark_kv_ablations.py",
    "test_real_model.py",
    "test_benchmarks_run.py",
    "test_benchmark_kv_allocation_replay.py",
    "test_real_beam_search.py",
    "test_readme.py",
    "test_eval_runner.py",
    "test_kv_heads.py",
)


def pytest_collection_modifyitems(config, items):
    """Collect the files of ``SLOWEST_FILES`` first, in its order (each file's tests keep theirs)."""
    rank = {name: index for index, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A directory holding the tiny model and tokenizer, loadable with ``load_model(dir)``."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    """``(model, tokenizer)`` of the tiny model, loaded through decodekit's loader."""
    from decodekit import load_model

    return load_model(tiny_model_dir)


@pytest.fixture(scope="session")
def real():
    """``(model, tokenizer)`` of the embedded default model (SmolLM2-135M-Instruct)."""
    from decodekit import load_model

    return load_model()


@pytest.fixture
def fresh_tiny(tiny):
    """A fresh copy of the tiny model, so that cache hooks bound in one test never reach another."""
    from tests.tiny import build_model

    _, tokenizer = tiny
    return build_model(tokenizer), tokenizer
