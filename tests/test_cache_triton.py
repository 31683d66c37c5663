"""The Triton scoring kernels against a float64 softmax and against the eager attention weights.

On a CUDA machine the kernels run compiled on the GPU; elsewhere they run in Triton's interpreter
on the CPU (TRITON_INTERPRET=1, set by conftest.py), which executes the same kernel code program by
program.
"""

from __future__ import annotations

import os

import pytest
import torch

from decodekit.cache import CompressedCache
from tests.families import build_family_model

triton = pytest.importorskip("triton", reason="the Triton kernels need the triton package (a dev dependency)")
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


@pytest.fixture(scope="module")
def kernels():
    """The kernel module, compiled on CUDA or interpreted on the CPU."""
    assert CUDA or os.environ.get("TRITON_INTERPRET") == "1", "conftest.py sets TRITON_INTERPRET without CUDA"
    from decodekit.cache import _triton_scoring

    return _triton_scoring


def _softmax_column_sums(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """The oracle in float64: the full causal attention matrix, summed over queries and each KV head's group."""
    batch, heads, window, _ = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    logits = queries.double() @ keys.double().repeat_interleave(group, dim=1).transpose(-1, -2) * scaling
    last_seen = slots - window + torch.arange(window, device=keys.device)[:, None]
    visible = torch.arange(slots, device=keys.device) <= last_seen
    probabilities = logits.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return probabilities.sum(dim=2).view(batch, kv_heads, group, slots).sum(dim=2)


@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "window", "slots", "head_dim"),
    [
        (1, 4, 2, 30, 30, 16),  # a whole prompt, grouped-query attention
        (2, 4, 1, 70, 150, 24),  # the last 70 queries after 80 cached keys; head_dim not a power of two
        (1, 2, 2, 130, 200, 64),  # several tiles each way
        (1, 3, 3, 2, 5, 8),  # fewer queries and keys than one tile
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_sums_equal_a_float64_softmax(kernels, batch, heads, kv_heads, window, slots, head_dim, dtype):
    generator = torch.Generator().manual_seed(slots)
    queries = torch.randn(batch, heads, window, head_dim, generator=generator).to(DEVICE, dtype)
    keys = torch.randn(batch, kv_heads, slots, head_dim, generator=generator).to(DEVICE, dtype)
    scaling = head_dim**-0.5
    received = kernels.attention_received(queries, keys, scaling)
    assert received.dtype == torch.float32 and received.shape == (batch, kv_heads, slots)
    expected = _softmax_column_sums(queries, keys, scaling)
    torch.testing.assert_close(received.double(), expected, atol=2e-5, rtol=2e-5)


def test_the_kernels_hold_no_attention_matrix(kernels):
    """Memory: a 4096-token pass needs no more than its inputs and a float per query and per key."""
    if not CUDA:
        pytest.skip("peak memory is measured on CUDA; the interpreter on a CPU allocates differently")
    queries = torch.randn(1, 32, 4096, 64, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(1, 8, 4096, 64, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    kernels.attention_received(queries, keys, 0.125)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= 4 * (32 * 4096 + 8 * 4096) + (1 << 20)  # lse and the sums, plus allocator rounding


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
def test_a_cache_scoring_with_the_kernels_matches_eager_attention_and_the_torch_path(kernels, family):
    model = build_family_model(family).to(DEVICE)
    ids = torch.randint(3, 384, (2, 40), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        attentions = model(ids, output_attentions=True).attentions
        model.set_attn_implementation("sdpa")
        caches = {}
        for backend in ("triton", "torch"):
            caches[backend] = CompressedCache(
                model, compression_ratio=0.0, recent_tokens=1, sink_tokens=0, scoring_backend=backend
            )
            model(ids, past_key_values=caches[backend])
    kv_heads = model.config.num_key_value_heads
    seen_by = torch.arange(40, 0, -1, dtype=torch.float32, device=DEVICE)
    for ours, blocked, weights in zip(caches["triton"].layers, caches["torch"].layers, attentions, strict=True):
        expected = (weights.sum(dim=2) / seen_by).view(2, kv_heads, -1, 40).mean(dim=2)
        assert ours.scores_on_triton and not blocked.scores_on_triton  # each on its backend
        assert torch.equal(ours.positions(), torch.arange(40, device=DEVICE).int().expand(2, kv_heads, -1))
        torch.testing.assert_close(ours.scores(), expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.scores(), blocked.scores(), atol=1e-6, rtol=1e-5)


def test_generation_with_the_kernels_keeps_what_the_torch_path_keeps(kernels):
    model = build_family_model("llama").to(DEVICE)
    ids = torch.randint(3, 384, (1, 90), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    outputs, kept = {}, {}
    for backend in ("triton", "torch"):
        cache = CompressedCache(model, budget=40, sink_tokens=2, recent_tokens=8, scoring_backend=backend)
        outputs[backend] = model.generate(
            ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=12, do_sample=False
        )
        kept[backend] = [layer.kept_positions().tolist() for layer in cache.layers]
    assert torch.equal(outputs["triton"], outputs["torch"])
    assert kept["triton"] == kept["torch"]


def test_the_triton_backend_on_a_cpu_without_the_interpreter_is_refused(monkeypatch):
    if CUDA:
        pytest.skip("this machine has CUDA, so the Triton backend is available")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = build_family_model("llama")
    cache = CompressedCache(model, budget=40, scoring_backend="triton")
    with pytest.raises(ValueError, match="scoring_backend='triton' needs the cache on a CUDA device; it is on cpu"):
        model(torch.randint(3, 384, (1, 50)), past_key_values=cache)


def test_an_unknown_scoring_backend_is_named():
    model = build_family_model("llama")
    with pytest.raises(ValueError, match="scoring_backend must be one of 'auto', 'triton', 'torch'; got 'cuda'"):
        CompressedCache(model, budget=40, scoring_backend="cuda")


@pytest.mark.parametrize(
    ("heads", "kv_heads", "length", "head_dim", "chunk"),
    [
        (4, 2, 30, 16, 64),  # one chunk, fewer tokens than a tile
        (4, 1, 150, 24, 48),  # chunks that end inside a tile; head_dim not a power of two
        (2, 2, 200, 64, 100),  # several tiles each way
    ],
)
def test_replay_estimate_kernels_equal_the_pytorch_estimate(heads, kv_heads, length, head_dim, chunk):
    """The replay estimate's kernels (``_triton_replay.py``) against its blocked PyTorch path, which
    ``test_kv_replay_estimate.py`` checks against a naive loop."""
    from decodekit.cache.replay_estimate import replay_scores

    generator = torch.Generator().manual_seed(length)
    queries = torch.randn(2, heads, length, head_dim, generator=generator).to(DEVICE)
    keys = torch.randn(2, kv_heads, length, head_dim, generator=generator).to(DEVICE)
    angles = torch.arange(length, device=DEVICE)[None, :, None] * torch.logspace(0, -3, head_dim // 2, device=DEVICE)
    cos, sin = angles.repeat(2, 1, 2).cos(), angles.repeat(2, 1, 2).sin()
    expected = replay_scores(queries, keys, head_dim**-0.5, cos, sin, chunk=chunk)
    received = replay_scores(queries, keys, head_dim**-0.5, cos, sin, chunk=chunk, kernels=True)
    torch.testing.assert_close(received, expected, atol=1e-6, rtol=1e-4)
    assert (expected > 0.05).any()  # the comparison is not of zeros


def test_a_cache_on_the_kernels_estimates_its_replay_as_the_pytorch_path_does():
    model = build_family_model("qwen2")
    ids = torch.randint(3, 384, (1, 90), generator=torch.Generator().manual_seed(4))
    scores = {}
    for backend in ("torch", "triton"):
        cache = CompressedCache(model.to(DEVICE), compression_ratio=0.5, scoring="reconstruction",
                                replay="prompt_queries", reconstruction_chunk=40, scoring_backend=backend)  # fmt: skip
        with torch.no_grad():
            model(ids.to(DEVICE), past_key_values=cache)
        scores[backend] = [(layer.positions(), layer.scores()) for layer in cache.layers]
    for (positions, with_kernels), (expected_positions, expected) in zip(scores["triton"], scores["torch"],
                                                                         strict=True):  # fmt: skip
        assert torch.equal(positions, expected_positions)
        torch.testing.assert_close(with_kernels, expected, atol=1e-6, rtol=1e-4)
