"""A decoding step that reads coded entries (or heads of their own lengths) where they lie, through decodekit's
wrapper of the sdpa attention function, against the oracle of a dense copy of every entry read by SDPA; and the
kernels that read the codes: Triton's (under its interpreter on a CPU) and the C++ operator of CPU steps."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

import decodekit.cache.attention as attention
from decodekit.cache import CompressedCache
from decodekit.cache.coding import PlainCoding, QuantizedCoding
from decodekit.cache.fused_step import FusedSteps
from decodekit.cache.storage import EntryStorage, Field
from tests.decode_steps import greedy_steps, prompt_batch
from tests.families import build_family_model
from tests.tiny import build_model

SETTINGS = {
    "4 bits, budget": {"budget": 64, "kv_bits": 4, "residual_length": 0},
    "8-bit keys, 4-bit values, residual": {"budget": 64, "kv_bits": 4, "key_bits": 8},
    "16 bits of a 32-bit model": {"budget": 64, "kv_bits": 16},
    "heads of their own lengths": {"compression_ratio": 0.6, "scoring": "reconstruction"},
    "byte-sized": {"memory_fraction": 0.25, "scoring": "reconstruction"},
}


@pytest.fixture
def fresh(tiny):
    _, tokenizer = tiny
    return build_model(tokenizer), tokenizer


def _decode(model, cache, batch, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Greedy steps by hand after the prompt's pass: each step's logits and the kept positions after it."""
    taken = greedy_steps(model, cache, batch, steps, lambda cache: [layer.kept_positions() for layer in cache.layers])
    return [logits for logits, _ in taken], [kept for _, kept in taken]


@pytest.mark.parametrize("case", list(SETTINGS))
@pytest.mark.parametrize("rows", [1, 2])
def test_a_step_reading_its_entries_itself_equals_sdpa_over_a_dense_copy(fresh, monkeypatch, case, rows):
    """Oracle: the same cache decoding with every entry decoded into a dense copy that SDPA reads (the wrapper told
    to pass every call on). The logits agree to float rounding, the same tokens are kept, and the wrapper answered
    the steps (it was not passed over)."""
    model, tokenizer = fresh
    batch = prompt_batch(tokenizer, rows=rows, padded=rows == 2 and "reconstruction" not in str(SETTINGS[case]))
    answered = []
    attention.install()  # (before the patch: the wrapper's original is SDPA's own)
    original = attention._attention

    def counting(module, query, *args, **kwargs):
        answered.append(id(module) in attention._READS.reads)
        return original(module, query, *args, **kwargs)

    monkeypatch.setattr(attention, "_attention", counting)
    monkeypatch.setitem(attention.ALL_ATTENTION_FUNCTIONS._local_mapping, attention.WRAPPED, counting)
    cache = CompressedCache(model, **SETTINGS[case])
    read = _decode(model, cache, batch, steps=12)
    # Every layer whose entries attention cannot read as they are answered every step itself.
    readers = [layer for layer in cache.layers if not (layer.coding.reads_in_place() and layer.storage.rectangular)]
    assert readers and sum(answered) == 12 * len(readers)
    monkeypatch.setattr(attention, "answers", lambda module: False)  # every step reads a dense copy through SDPA
    dense = _decode(model, CompressedCache(model, **SETTINGS[case]), batch, steps=12)
    for ours, theirs in zip(read[0], dense[0], strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=2e-4)
    for ours, theirs in zip(read[1], dense[1], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_a_model_on_eager_attention_reads_a_dense_copy(fresh):
    """Where the model's attention calls never reach the wrapper (eager attention), steps read a dense copy: the same
    tokens as SDPA's steps over the same cache."""
    model, tokenizer = fresh
    batch = prompt_batch(tokenizer)
    settings = SETTINGS["byte-sized"]
    sdpa = _decode(model, CompressedCache(model, **settings), batch, steps=8)
    model.set_attn_implementation("eager")
    eager = _decode(model, CompressedCache(model, **settings), batch, steps=8)
    assert all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(sdpa[0], eager[0], strict=True))


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "mistral-sliding", "phi3"])
def test_other_families_read_their_steps_as_a_dense_copy_does(monkeypatch, family):
    """Query norms (keys rotated back when read), sliding windows, logit caps and partial rotary embeddings: the
    steps a layer reads itself give the logits of a dense copy read by SDPA."""
    model = build_family_model(family)
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    settings = {"budget": 24, "sink_tokens": 2, "recent_tokens": 8, "kv_bits": 4, "residual_length": 0}

    def run():
        cache = CompressedCache(model, **settings)
        with torch.no_grad():
            last = model(ids, past_key_values=cache).logits[:, -1:]
            steps = []
            for step in range(10):
                token = last.argmax(dim=-1)
                last = model(token, past_key_values=cache, position_ids=torch.tensor([[40 + step]])).logits
                steps.append(last)
        return steps

    read = run()
    monkeypatch.setattr(attention, "answers", lambda module: False)
    for ours, theirs in zip(read, run(), strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=2e-4)


def _storage(coding, batch: int, heads: int, head_dim: int, seed: int, dtype: torch.dtype = torch.float32):
    """A storage of ``coding``'s entries (of a model in ``dtype``) whose segments hold 13, 9, 11 and 13 entries, then
    one step's token each; returns it, the step's exact key and value, and every entry decoded (the step's own
    exact)."""
    generator = torch.Generator().manual_seed(seed)
    common = 3.0 * torch.randn(head_dim, generator=generator)  # a part every key shares, which smoothing takes out
    first = torch.randn(batch, heads, 7, head_dim, generator=generator) + common
    coding.start(first.to(dtype))
    fields = {**coding.fields(head_dim), "positions": Field((), torch.int32), "biases": Field((), torch.float16)}
    storage = EntryStorage(fields, batch, heads, 4, "cpu")
    for count in (7, 6):
        keys, values = (torch.randn(batch, heads, count, head_dim, generator=generator) for _ in range(2))
        entries, _ = coding.encode(keys + common, values)
        positions = storage.length_range[1] + torch.arange(count, dtype=torch.int32)
        biases = torch.randn(batch, heads, count, generator=generator).half()
        storage.append({**entries, "positions": positions.expand(batch, heads, count), "biases": biases}, count)
    storage.keep(torch.arange(13).expand(batch, heads, 13), np.array([[13, 9], [11, 13]])[:batch, :heads])
    own_keys, own_values = (torch.randn(batch, heads, 1, head_dim, generator=generator) for _ in range(2))
    entries, read_keys = coding.encode(own_keys + common, own_values)
    storage.append({**entries, "positions": torch.full((batch, heads, 1), 20, dtype=torch.int32), "biases": 0.0}, 1)
    keys, values = coding.decode(storage, storage.length_range[1], dtype=torch.float32)
    last = (storage.lengths - 1)[..., None, None].expand(-1, -1, 1, head_dim)
    keys.scatter_(2, last, read_keys.float())
    values.scatter_(2, last, own_values)
    return storage, read_keys, own_values, keys, values


KERNELS = {"triton": "decodekit.cache._triton_attention", "native": "decodekit.cache._native"}


@pytest.mark.parametrize(("key_bits", "value_bits"),
                         [(5, 4), (4, 4), (8, 8), (3, 2), (2, 3), (None, 4), (4, None), (None, None)])
@pytest.mark.parametrize("extras", ["plain", "biases", "softcap", "window"])
@pytest.mark.parametrize(("kernel", "head_dim", "group_size", "dtype"), [
    ("triton", 16, 8, torch.float32), ("native", 16, 8, torch.float32), ("native", 64, 8, torch.float32),
    ("native", 128, 8, torch.bfloat16), ("native", 8, 8, torch.float32), ("native", 80, 8, torch.bfloat16),
    ("native", 16, 4, torch.float32),
])  # fmt: skip
def test_the_kernels_read_codes_as_decoded_entries_read_them(
    key_bits, value_bits, extras, kernel, head_dim, group_size, dtype
):
    """Oracle: the entries decoded to float32 and attended in PyTorch (``attention.read_decoded``) with a hand-made
    mask of each segment's length; the Triton kernels run in Triton's interpreter, the C++ operator as built (its
    AVX2 blocks where entries hold a multiple of eight channels in groups of a multiple of eight, where the CPU has
    AVX2 — 64 channels at a time, then eight at a time for the rest, as 80 channels read; its scalar loop for groups
    of four), over segments of different lengths, every width of keys and values, with biases, a logit cap or a
    sliding window, for float32 and bfloat16 models (scales and plain entries in float16, bfloat16 or float32).
    Keys share a large common part, which smoothed keys take out before coding and the kernels give back."""
    step_attention = importlib.import_module(KERNELS[kernel]).step_attention

    batch, heads, query_heads = 2, 2, 4
    if key_bits is None and value_bits is None:
        coding = PlainCoding()
    else:
        coding = QuantizedCoding(key_bits, value_bits, group_size, 0)
        coding.rotated_reads = True  # the queries come rotated as the keys were coded
    storage, read_keys, own_values, keys, values = _storage(coding, batch, heads, head_dim, seed=key_bits or 3,
                                                            dtype=dtype)  # fmt: skip
    query = torch.randn(batch, query_heads, 1, head_dim, generator=torch.Generator().manual_seed(7))
    slots = storage.length_range[1]
    visible = torch.arange(slots) < storage.lengths[..., None]
    options = {"softcap": 3.0} if extras == "softcap" else {}
    if extras == "window":
        positions = storage.read("positions", slots).long()
        visible &= (20 - positions < 6) | (torch.arange(slots) == storage.lengths[..., None] - 1)
        options = {"window": 6, "query_position": 20}
    mask = visible[:, :, None, :].repeat_interleave(2, dim=1)
    if extras == "biases":
        biases = torch.where(visible, storage.read("biases", slots).float(), 0.0)
        biases = torch.where(torch.arange(slots) == storage.lengths[..., None] - 1, 0.0, biases)
        mask = torch.where(mask, biases[:, :, None, :].repeat_interleave(2, dim=1), -torch.inf)
        options = {"biased": True}
    expected, expected_received = attention.read_decoded(query, keys, values, 0.25, mask, options.get("softcap"))
    smoothed = coding.quantized and coding.smoothing
    if smoothed:
        options["key_means"] = coding.read_key_means()
    output, received = step_attention(query, storage, (key_bits, value_bits), group_size, read_keys, own_values,
                                      0.25, **options)  # fmt: skip
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(received, expected_received, atol=1e-6, rtol=1e-5)
    if smoothed and extras != "window":  # (the mean matters where stored keys are seen: without it, other weights)
        del options["key_means"]
        _, unsmoothed = step_attention(query, storage, (key_bits, value_bits), group_size, read_keys, own_values,
                                       0.25, **options)  # fmt: skip
        assert not torch.allclose(unsmoothed, expected_received, atol=1e-3)


def test_a_cache_told_to_read_with_triton_decodes_as_the_torch_path(fresh):
    """End to end on the interpreter: the byte-sized cache (heads of their own lengths, 5-bit keys, 4-bit values,
    the first layer's biases) with ``scoring_backend="triton"`` decodes the tokens and keeps the entries of
    ``scoring_backend="torch"``."""
    model, tokenizer = fresh
    batch = prompt_batch(tokenizer)
    runs = [_decode(model, CompressedCache(model, **SETTINGS["byte-sized"], scoring_backend=backend), batch, 6)
            for backend in ("torch", "triton")]  # fmt: skip
    (torch_logits, torch_kept), (triton_logits, triton_kept) = runs
    for ours, theirs in zip(triton_logits, torch_logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=2e-4)
    for ours, theirs in zip(triton_kept, torch_kept, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("setting", ["byte-sized", "8-bit keys, 4-bit values, residual"])
def test_the_cpu_operator_is_built_and_answers_the_steps_of_auto(fresh, monkeypatch, setting):
    """On a CPU, ``scoring_backend="auto"`` reads the steps of the byte-sized cache and of a budget coded in 8 and 4
    bits with a residual window with the C++ operator (it was called once per layer and step, alone or inside a fused
    step): the tokens and the
    kept entries of ``scoring_backend="torch"``, which decodes the entries in PyTorch, and its logits to float
    rounding."""
    native = importlib.import_module(KERNELS["native"])
    assert native.available(), "the C++ operator did not build (a C++ compiler and ninja are needed)"
    calls = []
    original = native.step_attention
    monkeypatch.setattr(native, "step_attention", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    fused = FusedSteps.step  # (a step run as one operator reads with the same C++ attention: fused_step.py)
    monkeypatch.setattr(FusedSteps, "step", lambda self, *args: calls.append(1) or fused(self, *args))
    model, tokenizer = fresh
    batch = prompt_batch(tokenizer)
    runs = [_decode(model, CompressedCache(model, **SETTINGS[setting], scoring_backend=backend), batch, 6)
            for backend in ("torch", "auto")]  # fmt: skip
    assert len(calls) == 6 * model.config.num_hidden_layers
    (torch_logits, torch_kept), (native_logits, native_kept) = runs
    for ours, theirs in zip(native_logits, torch_logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=2e-4)
    for ours, theirs in zip(native_kept, torch_kept, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize(("key_bits", "value_bits"), [(5, 4), (8, 8), (3, 2), (4, None)])
@pytest.mark.parametrize(("head_dim", "group_size", "dtype"), [(16, 8, torch.float32), (64, 8, torch.bfloat16),
                                                                (16, 4, torch.float32)])  # fmt: skip
def test_the_cpu_operator_reads_the_residual_windows_tokens_exact(key_bits, value_bits, head_dim, group_size, dtype):
    """Oracle: ``QuantizedCoding.decode``, which writes the residual window's exact entries over their codes, then
    attention in PyTorch. The window holds the last 5 tokens written (positions 15 to 19; some segments evicted
    some of them), the step's own token is the exact one it is handed; AVX2 blocks and the scalar loop."""
    native = importlib.import_module(KERNELS["native"])
    batch, heads, query_heads = 2, 2, 4
    generator = torch.Generator().manual_seed(11)
    coding = QuantizedCoding(key_bits, value_bits, group_size, 5)
    coding.rotated_reads = True
    first = torch.randn(batch, heads, 20, head_dim, generator=generator)
    coding.start(first.to(dtype))
    storage = EntryStorage({**coding.fields(head_dim), "positions": Field((), torch.int32)}, batch, heads, 4, "cpu")
    keys, values = (torch.randn(batch, heads, 20, head_dim, generator=generator).to(dtype) for _ in range(2))
    entries, read_keys = coding.encode(keys, values)
    positions = torch.arange(20, dtype=torch.int32)
    storage.append({**entries, "positions": positions.expand(batch, heads, 20)}, 20)
    coding.remember(read_keys, values, positions)
    kept = torch.tensor([[[0, 3, 16, 5, 19, 9, 17], [18, 2, 15, 11, 4, 1, 7]],
                         [[19, 18, 17, 16, 15, 0, 6], [12, 13, 14, 8, 10, 3, 2]]])  # fmt: skip
    storage.keep(kept, 7)
    own_keys, own_values = (torch.randn(batch, heads, 1, head_dim, generator=generator).to(dtype) for _ in range(2))
    entries, own_read = coding.encode(own_keys, own_values)
    storage.append({**entries, "positions": torch.full((batch, heads, 1), 20, dtype=torch.int32)}, 1)
    coding.remember(own_read, own_values, torch.tensor([20], dtype=torch.int32))
    expected_keys, expected_values = coding.decode(storage, 8, dtype=torch.float32)
    expected_keys[:, :, 7:8] = own_read.float()
    expected_values[:, :, 7:8] = own_values.float()
    query = torch.randn(batch, query_heads, 1, head_dim, generator=generator)
    expected, expected_received = attention.read_decoded(query, expected_keys, expected_values, 0.25, None)
    output, received = native.step_attention(query, storage, (key_bits, value_bits), group_size, own_read.float(),
                                             own_values.float(), 0.25, residual=coding.residual_window(),
                                             key_means=coding.read_key_means())  # fmt: skip
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(received, expected_received, atol=1e-6, rtol=1e-5)
    without, _ = native.step_attention(query, storage, (key_bits, value_bits), group_size, own_read.float(),
                                       own_values.float(), 0.25, key_means=coding.read_key_means())  # fmt: skip
    assert not torch.allclose(without, expected, atol=1e-5, rtol=1e-5)  # (the window's exact entries were read)
