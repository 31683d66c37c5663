"""A coded layer's decoding step as one C++ operator (``fused_step.py``) against the four operators and the host's
eviction decisions it replaces: the same logits, the same entries, byte for byte.

Oracle: the same cache decoding step by step with fused steps turned off (``STEPS_PLANNED = 0``), whose evictions
``CompressedLayer.eviction_due`` decides at every step.
"""

from __future__ import annotations

import pytest
import torch

from decodekit.cache import CompressedCache, _native, fused_step
from decodekit.cache.fused_step import FusedSteps
from tests.decode_steps import assert_same_entries, logits_of_greedy_steps
from tests.families import VOCAB, build_family_model

CASES = {
    "memory_fraction, reconstruction": ("llama", {"memory_fraction": 0.3, "scoring": "reconstruction"}),
    "a budget, value norms ranked, a residual window": ("llama", {"budget": 40, "kv_bits": 4, "eviction_interval": 1}),
    "a budget at its floor, no residual window": (
        "llama", {"budget": 36, "kv_bits": 2, "eviction_interval": 1, "residual_length": 0}
    ),
    "8-bit keys, 3-bit values": ("llama", {"budget": 50, "key_bits": 8, "kv_bits": 3, "eviction_interval": 1}),
}


def _decode(model, options: dict, steps: int) -> tuple[torch.Tensor, CompressedCache]:
    """Greedy steps by hand after a two-row prompt; the logits of every step, and the cache."""
    cache = CompressedCache(model, **options)
    prompt = torch.randint(3, VOCAB, (2, 90), generator=torch.Generator().manual_seed(1))
    return logits_of_greedy_steps(model, cache, prompt, steps), cache


@pytest.mark.parametrize("case", list(CASES))
def test_fused_steps_give_the_step_by_step_logits_and_entries_byte_for_byte(monkeypatch, case):
    assert _native.available(), "the C++ operators did not build (a C++ compiler and ninja are needed)"
    family, options = CASES[case]
    model = build_family_model(family)
    fused_calls = []
    original = FusedSteps.step
    monkeypatch.setattr(FusedSteps, "step", lambda self, *args: fused_calls.append(1) or original(self, *args))
    fused, fused_cache = _decode(model, options, steps=60)
    assert len(fused_calls) >= 60, "most steps of every layer should run fused"  # (2 layers x 60 steps)
    monkeypatch.setattr(fused_step, "STEPS_PLANNED", 0)
    fused_calls.clear()
    plain, plain_cache = _decode(model, options, steps=60)
    assert not fused_calls
    assert torch.equal(fused, plain)
    assert_same_entries(fused_cache, plain_cache)


def test_fused_steps_do_not_run_where_a_step_does_more(monkeypatch):
    """A wider eviction interval (steps wait to be scored) and a model whose keys are not read rotated (query norms:
    the PyTorch step) take the step-by-step path."""
    fused_calls = []
    original = FusedSteps.step
    monkeypatch.setattr(FusedSteps, "step", lambda self, *args: fused_calls.append(1) or original(self, *args))
    cases = [
        ("llama", {"budget": 40, "kv_bits": 4, "eviction_interval": 4}),
        ("qwen3", {"memory_fraction": 0.3, "scoring": "reconstruction"}),
    ]
    for family, options in cases:
        _decode(build_family_model(family), options, steps=12)
        assert not fused_calls, (family, options)
    _decode(build_family_model("llama"), {"budget": 40, "kv_bits": 4, "eviction_interval": 1}, steps=12)
    assert fused_calls, "the same model without them runs fused steps"


def test_the_operator_refuses_drops_that_are_not_int64():
    assert _native.available()
    none = torch.zeros(0)
    codes = [torch.zeros(1, 1, dtype=torch.uint8), none, none] * 2
    lengths = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="decode_step: int64 drops"):
        torch.ops.decodekit.decode_step(
            [], codes, [none, none], [4, 4], 8, torch.zeros(1, dtype=torch.int32), 0, [], [], [], lengths, lengths,
            lengths + 1, none, none, none, 1.0, None, none, 1.0, None, lengths.int(), 1, 0, 0, 1e30, None, None, None,
        )  # fmt: skip
