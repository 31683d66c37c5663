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


def pytest_sessionstart(session) -> None:
    """Build the cache's CPU operators before any test runs (once per fresh home: about half a minute, which would
    otherwise fall inside whichever timed test first decodes a compressed cache; workers wait on PyTorch's lock)."""
    from decodekit.cache import _native

    _native.available()


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
