"""Quantized storage (``kv_bits``) and byte sizes (``memory_fraction``, ``max_bytes``) of CompressedCache.

Oracles: the quantizer against values worked out by hand and its own stated error bound; the
stored keys and values of the first layer (a function of the tokens alone) against a
DynamicCache's exact ones at the same positions; the byte sizes against ``memory_bytes()`` and
the full cache's size as ``full_cache_bytes`` counts it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import DynamicCache, LogitsProcessor

from decodekit.cache import CompressedCache
from decodekit.cache.coding import QuantizedCoding, mean_keys
from decodekit.cache.quantize import Quantizer, hadamard, rotate, rotation_block
from decodekit.cache.size import full_cache_bytes
from decodekit.cache.storage import EntryStorage, Field
from tests.families import build_family_model
from tests.tiny import build_model

PROMPT = " ".join(["The class statement creates a new class object and binds it to a name"] * 4)


@pytest.fixture
def fresh(tiny):
    _, tokenizer = tiny
    return build_model(tokenizer), tokenizer


# -- the quantizer ----------------------------------------------------------------------------------


def test_a_group_is_coded_by_hand():
    """[0, 1, 2, 3] at 8 bits: offset 0, scale 3/255 (in float32); codes round(x / scale)."""
    coded = Quantizer(bits=8, group_size=4).encode(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    scale = 3 / 255
    assert coded["offsets"].tolist() == [0.0]
    assert coded["scales"].item() == pytest.approx(scale, rel=1e-7)
    assert coded["codes"].tolist() == [0, round(1 / scale), round(2 / scale), round(3 / scale)]


def test_four_bit_codes_are_packed_two_per_byte_low_first():
    """Values 0..15 in one 16-channel group are their own codes (offset 0, scale 1)."""
    values = torch.arange(16.0)
    coded = Quantizer(bits=4, group_size=16).encode(values)
    assert coded["codes"].dtype == torch.uint8 and coded["codes"].shape == (8,)
    assert coded["codes"].tolist() == [
        low + 16 * high for low, high in zip(range(0, 16, 2), range(1, 16, 2), strict=True)
    ]


def test_two_and_three_bit_codes_are_four_a_byte_then_third_bits_eight_per_byte():
    """Values 0..3 (2 bits) and 0..7 (3 bits) in one group are their own codes (offset 0, scale 1): channel 4i + j in
    bits 2j and 2j + 1 of byte i; at 3 bits the third bits follow, channel 8i + j in bit j of their byte i."""
    two = Quantizer(bits=2, group_size=8).encode(torch.tensor([0.0, 1, 2, 3, 3, 2, 1, 0]))
    assert two["codes"].tolist() == [0 + 1 * 4 + 2 * 16 + 3 * 64, 3 + 2 * 4 + 1 * 16 + 0 * 64]
    values = torch.tensor([7.0, 0, 5, 2, 4, 1, 6, 3])
    three = Quantizer(bits=3, group_size=8).encode(values)
    low = [code % 4 for code in values.int().tolist()]
    assert three["codes"].tolist() == [low[0] + 4 * low[1] + 16 * low[2] + 64 * low[3],
                                       low[4] + 4 * low[5] + 16 * low[6] + 64 * low[7], 0b01010101]
    assert Quantizer(bits=3, group_size=8).decode(three, torch.float32).tolist() == values.tolist()


def test_five_bit_codes_are_nibbles_then_fifth_bits_eight_per_byte():
    """Values 0..31 in one 32-channel group are their own codes (offset 0, scale 1): bytes 0-15 hold the low 4
    bits two per byte (low half first), bytes 16-19 the fifth bits: channel 8i + 2j in bit j of byte 16 + i, channel
    8i + 2j + 1 in bit 4 + j."""
    values = torch.arange(32.0)
    coded = Quantizer(bits=5, group_size=32).encode(values)
    assert coded["codes"].dtype == torch.uint8 and coded["codes"].shape == (20,)
    assert coded["offsets"].tolist() == [0.0] and coded["scales"].tolist() == [1.0]
    nibbles = [(low % 16) + 16 * (high % 16) for low, high in zip(range(0, 32, 2), range(1, 32, 2), strict=True)]
    fifth = [0, 0, 255, 255]  # channels 0-15 are below 16, channels 16-31 are not
    assert coded["codes"].tolist() == nibbles + fifth
    odd = Quantizer(bits=5, group_size=8).encode(torch.tensor([16.0, 0, 0, 16, 0, 0, 0, 31]))
    assert odd["codes"][-1].item() == 0b10100001  # channels 0 (bit 0), 3 (bit 5) and 7 (bit 7) have a fifth bit
    assert Quantizer(bits=5, group_size=8).decode(odd, torch.float32).tolist() == [16.0, 0, 0, 16, 0, 0, 0, 31]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decoding_errs_by_at_most_half_a_step(bits, dtype):
    generator = torch.Generator().manual_seed(bits)
    values = (torch.randn(3, 2, 40, 64, generator=generator) * 4 + 1).to(dtype)
    values[0, 0, 0, 5] = 300.0  # an outlier widens its group only
    quantizer = Quantizer(bits=bits, group_size=16)
    coded = quantizer.encode(values)
    decoded = quantizer.decode(coded, dtype)
    assert decoded.dtype == dtype and coded["scales"].dtype == dtype
    step = coded["scales"].float().repeat_interleave(16, dim=-1)
    rounding = values.float().abs() * torch.finfo(dtype).eps  # the decoded value's own rounding to ``dtype``
    assert ((decoded.float() - values.float()).abs() <= step / 2 * (1 + 1e-3) + rounding).all()
    assert torch.isfinite(decoded).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("little_endian", [True, False])
def test_every_decoding_path_gives_offset_plus_code_times_scale(monkeypatch, bits, dtype, little_endian):
    """Decoding into a new tensor, in place into a view of a wider one (float32) or through a copy (bf16), and
    the byte-order fallback of 4-bit unpacking all give offset + code * scale, worked out from the codes by hand."""
    monkeypatch.setattr("decodekit.cache.quantize._LITTLE_ENDIAN", little_endian)
    generator = torch.Generator().manual_seed(bits)
    values = torch.randn(2, 3, 20, 64, generator=generator)
    quantizer = Quantizer(bits=bits, group_size=16)
    coded = quantizer.encode(values)
    codes = coded["codes"].long()
    if bits in (4, 5):  # channel 2i in the low half of byte i, 2i + 1 in the high half
        nibbles = codes[..., :32]
        low = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).flatten(-2)
        if bits == 5:  # then channel 8i + 2j's fifth bit in bit j of byte 32 + i, channel 8i + 2j + 1's in bit 4 + j
            bit_of_channel = [0, 4, 1, 5, 2, 6, 3, 7]
            fifth = torch.stack([(codes[..., 32:] >> bit) & 1 for bit in bit_of_channel], dim=-1).flatten(-2)
            low = low + 16 * fifth
        codes = low
    if bits in (2, 3):  # channel 4i + j in bits 2j, 2j + 1 of byte i; then channel 8i + j's third bit in bit j
        low = torch.stack([(codes[..., :16] >> (2 * j)) & 3 for j in range(4)], dim=-1).flatten(-2)
        if bits == 3:
            low = low + 4 * torch.stack([(codes[..., 16:] >> j) & 1 for j in range(8)], dim=-1).flatten(-2)
        codes = low
    expected = coded["offsets"].repeat_interleave(16, -1) + codes * coded["scales"].repeat_interleave(16, -1)
    expected = expected.to(dtype)
    wider = torch.full((2, 5, 24, 64), float("nan"), dtype=dtype)
    into = wider[:, 1:4, 2:22]  # a view whose rows are not contiguous with each other
    assert quantizer.decode(coded, dtype, out=into) is into
    torch.testing.assert_close(quantizer.decode(coded, dtype), expected, rtol=0, atol=0)
    torch.testing.assert_close(into, expected, rtol=0, atol=0)
    assert wider[:, 0].isnan().all() and wider[:, 1:4, :2].isnan().all()  # nothing written outside the view


def test_a_constant_group_decodes_exactly():
    values = torch.full((2, 32), -1.5)
    quantizer = Quantizer(bits=4, group_size=32)
    assert torch.equal(quantizer.decode(quantizer.encode(values), torch.float32), values)


@pytest.mark.parametrize("widths", [(5, 4), (4, 5), (8, 4), (5, 8), (4, 4), (3, 2), (2, 3), (4, 2), (8, 3), (2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_parts_coded_together_in_other_widths_get_what_each_codes_alone(widths, dtype):
    """Keys and values coded in one pass (``encode_together``) store exactly what each quantizer codes alone: the
    same codes, scales and offsets, whatever the two widths; groups with outliers, constant groups and zeros
    included."""
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 3, 5, 64, generator=generator), torch.randn(2, 3, 5, 64, generator=generator)
    keys[0, 1, 2, 7] = 40.0  # an outlier channel
    values[1, 0, 3, :32] = -2.5  # a constant group
    keys[1, 2, 4] = 0.0
    quantizers = [Quantizer(bits=widths[0], rotated=True), Quantizer(bits=widths[1])]
    parts = [quantizer.as_coded(part) for quantizer, part in zip(quantizers, (keys, values), strict=True)]
    together = quantizers[1].encode_together(parts, dtype, quantizers)
    for quantizer, part, coded in zip(quantizers, (keys, values), together, strict=True):
        alone = quantizer.encode(part, dtype)
        assert coded.keys() == alone.keys()
        for name in alone:
            assert coded[name].dtype == alone[name].dtype and torch.equal(coded[name], alone[name]), name


def _sylvester_free_hadamard(size: int) -> torch.Tensor:
    """The orthonormal Hadamard matrix from its closed form: ``(-1) ** popcount(i & j) / sqrt(size)``."""
    signs = [[(-1) ** bin(i & j).count("1") for j in range(size)] for i in range(size)]
    return torch.tensor(signs, dtype=torch.float32) / math.sqrt(size)


@pytest.mark.parametrize("head_dim", [16, 64, 80, 96, 128])
def test_keys_are_turned_by_block_hadamard_matrices_that_undo_themselves(head_dim):
    block = rotation_block(head_dim)
    assert head_dim % block == 0 and block & (block - 1) == 0 and (head_dim // block) % 2 == 1
    assert torch.equal(hadamard(block), _sylvester_free_hadamard(block))
    values = torch.randn(3, head_dim, generator=torch.Generator().manual_seed(head_dim))
    by_hand = torch.block_diag(*[_sylvester_free_hadamard(block)] * (head_dim // block))
    assert torch.allclose(rotate(values), values @ by_hand, atol=1e-6)
    assert torch.allclose(rotate(rotate(values)), values, atol=1e-5)


def test_a_rotated_quantizer_codes_the_turned_entry_and_turns_the_decoded_one_back():
    values = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3)) * 2
    turn = _sylvester_free_hadamard(64)
    rotated, plain = Quantizer(bits=4, group_size=32, rotated=True), Quantizer(bits=4, group_size=32)
    coded = rotated.encode(values)
    expected = plain.encode(values @ turn)
    for name in ("codes", "scales", "offsets"):
        assert torch.equal(coded[name], expected[name])
    assert torch.allclose(rotated.decode(coded, torch.float32), plain.decode(expected, torch.float32) @ turn, atol=1e-5)


def test_rotation_shrinks_the_error_of_keys_with_outlier_channels():
    """Keys whose channel 3 is 20 times the others' size (as real keys' outlier channels are): the rotated coding's
    error is well below that of coding the channels as they are (about 1.1 against 1.9 here)."""
    keys = torch.randn(200, 64, generator=torch.Generator().manual_seed(0))
    keys[:, 3] *= 20
    errors = {}
    for rotated in (False, True):
        quantizer = Quantizer(bits=4, group_size=32, rotated=rotated)
        errors[rotated] = (quantizer.decode(quantizer.encode(keys), torch.float32) - keys).norm(dim=-1).mean()
    assert errors[True] < 0.7 * errors[False]


def _coded(coding, keys: torch.Tensor) -> EntryStorage:
    """``keys`` ``[batch, heads, tokens, head_dim]`` taken as a first pass by ``coding`` (a ``QuantizedCoding``) and
    stored (with zero values)."""
    batch, heads, tokens, head_dim = keys.shape
    coding.start(keys)
    storage = EntryStorage({**coding.fields(head_dim), "positions": Field((), torch.int32)}, batch, heads, tokens,
                           "cpu")  # fmt: skip
    entries, _ = coding.encode(keys, torch.zeros_like(keys))
    storage.append({**entries, "positions": torch.arange(tokens, dtype=torch.int32).expand(batch, heads, tokens)},
                   tokens)  # fmt: skip
    return storage


def _decoded_keys(coding, storage: EntryStorage) -> torch.Tensor:
    return coding.decode(storage, storage.length_range[1], dtype=torch.float32)[0]


def test_smoothed_keys_code_what_tells_keys_apart():
    """Keys sharing a common part four times their own size (Gemma 3's keys hold 20-70% of their energy in their
    mean): coded in 4 bits less their mean and given it back, they err a third as much as coded whole (the oracle:
    the exact keys)."""
    generator = torch.Generator().manual_seed(5)
    common = 4 * torch.randn(64, generator=generator)
    keys = torch.randn(2, 3, 40, 64, generator=generator) + common
    errors = {}
    for smooth in (True, False):
        coding = QuantizedCoding(4, 4, 32, 0, smooth_keys=smooth)
        errors[smooth] = (_decoded_keys(coding, _coded(coding, keys)) - keys).norm(dim=-1).mean()
    assert errors[True] < errors[False] / 3


def test_a_rows_mean_key_counts_its_tokens_after_its_left_padding():
    """Oracle: the mean of each row's own tokens, taken by hand; padding never moves a row's mean, and a row of
    padding alone takes out nothing (zeros)."""
    keys = torch.randn(4, 2, 6, 8, generator=torch.Generator().manual_seed(1)) + 4
    means = mean_keys(keys, np.array([0, 2, 5, 6]))
    for row, pads in enumerate((0, 2, 5)):
        torch.testing.assert_close(means[row], keys[row, :, pads:].mean(dim=1, keepdim=True))
    assert torch.equal(means[3], torch.zeros(2, 1, 8))


def test_a_first_pass_of_one_token_smooths_by_that_key_and_later_keys_read_within_their_steps():
    """The edge of a first pass: one token, whose key is its own mean, so it is coded as zeros and read back exact;
    keys coded later read within their half steps' length (the oracle: the exact keys)."""
    generator = torch.Generator().manual_seed(6)
    first = torch.randn(1, 2, 1, 32, generator=generator) + 3
    coding = QuantizedCoding(4, 4, 32, 0)
    storage = _coded(coding, first)
    assert coding.smoothing and torch.equal(coding.key_means, first)
    torch.testing.assert_close(_decoded_keys(coding, storage), first, atol=1e-6, rtol=0)
    later = torch.randn(1, 2, 5, 32, generator=generator) + 3
    entries, _ = coding.encode(later, torch.zeros_like(later))
    storage.append({**entries, "positions": torch.arange(1, 6, dtype=torch.int32).expand(1, 2, 5)}, 5)
    error = (_decoded_keys(coding, storage)[:, :, 1:] - later).norm(dim=-1)
    steps = storage.read("key_scales", 6)[:, :, 1:].float().repeat_interleave(32, -1)
    assert (error <= (steps / 2).norm(dim=-1) + 1e-3).all()


@pytest.mark.parametrize(("family", "smooths"), [("gemma3", True), ("qwen3", True), ("llama", False),
                                                 ("mistral", False)])  # fmt: skip
def test_keys_are_smoothed_by_default_where_the_model_normalizes_them(family, smooths):
    """``smooth_keys=None`` (the default) smooths coded keys where the attention modules normalize keys (Gemma 3 and
    Qwen3 have a key norm), and codes them whole elsewhere; True or False is taken as given."""
    model = build_family_model(family)
    ids = torch.randint(3, 300, (1, 50), generator=torch.Generator().manual_seed(0))
    for given, expected in ((None, smooths), (True, True), (False, False)):
        cache = CompressedCache(model, budget=40, kv_bits=4, smooth_keys=given)
        assert cache.options.storage.smooth_keys is expected
        with torch.no_grad():
            model(ids, past_key_values=cache)
        assert all(layer.coding.smoothing is expected for layer in cache.layers)


@pytest.mark.parametrize("smooth", [True, False])
def test_a_restored_coding_decodes_its_keys_as_the_saved_one(smooth):
    """A coding restored from a saved state (``state``/``restore``, as a saved cache is) decodes the same codes to
    the same keys; a state saved with keys coded whole (no mean keys in it) restores unsmoothed."""
    keys = torch.randn(1, 2, 9, 32, generator=torch.Generator().manual_seed(2)) + 3
    saved = QuantizedCoding(4, 4, 32, 0, smooth_keys=smooth)
    storage = _coded(saved, keys)
    restored = QuantizedCoding(4, 4, 32, 0)
    restored.restore(torch.float32, saved.state(), "cpu")
    assert restored.smoothing is smooth
    assert torch.equal(_decoded_keys(restored, storage), _decoded_keys(saved, storage))


def test_bad_quantization_settings_are_refused_by_name(fresh):
    model, _ = fresh
    with pytest.raises(ValueError, match=r"smooth_keys must be True, False or None \(where .*\); got 'yes'"):
        CompressedCache(model, budget=40, kv_bits=4, smooth_keys="yes")
    with pytest.raises(ValueError, match="kv_bits must be one of 16, 8, 5, 4, 3, 2 or None"):
        CompressedCache(model, budget=40, kv_bits=1)
    with pytest.raises(ValueError, match="kv_bits must be one of"):
        CompressedCache(model, budget=40, kv_bits=True)
    with pytest.raises(ValueError, match=r"kv_group_size must divide the model's head_dim \(16\)"):
        CompressedCache(model, budget=40, kv_bits=8, kv_group_size=5)
    with pytest.raises(ValueError, match="kv_group_size must be an integer >= 1"):
        CompressedCache(model, budget=40, kv_bits=8, kv_group_size=0)


# -- what attention reads ---------------------------------------------------------------------------


def _exact_first_layer(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first layer's keys and values at every position, from a full cache."""
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return cache.layers[0].keys, cache.layers[0].values


def _assert_within_a_step(layer, exact_keys, exact_values, *, ring_in_use: bool = True):
    """Every entry ``layer`` holds reads (``decoded``) within half a quantization step of the exact entry at
    its position, and entries held in the residual window read exactly (in 16 bits)."""
    keys, values = layer.decoded()
    held_positions = layer.positions().long()  # -1 past a segment's entries
    live = (held_positions >= 0)[..., None]
    assert bool(live.any())
    positions = held_positions.clamp(min=0, max=exact_keys.shape[2] - 1)
    index = positions[..., None].expand(-1, -1, -1, keys.shape[-1])
    true_keys, true_values = exact_keys.gather(2, index), exact_values.gather(2, index)
    if layer.coding.rotated_reads:  # attention reads the keys rotated, as they were coded
        true_keys = rotate(true_keys)
    group = layer.coding.quantizers["keys"].group_size
    key_step = layer.storage.read("key_scales", layer.longest).float().repeat_interleave(group, -1)
    value_step = layer.storage.read("value_scales", layer.longest).float().repeat_interleave(group, -1)
    tolerance = 1e-3  # float16 rounding of the ring and of the scales' products
    # Keys are coded rotated by an orthonormal matrix: each rotated channel errs by at most half its step, so the
    # key's error has at most the length of those half steps (an orthonormal turn keeps lengths).
    key_error = (keys - true_keys).norm(dim=-1, keepdim=True)
    key_bound = (key_step / 2).norm(dim=-1, keepdim=True)
    value_error = (values - true_values).abs()
    assert ((key_error <= key_bound + tolerance) | ~live).all()
    assert ((value_error <= value_step / 2 + tolerance) | ~live).all()
    if not ring_in_use:
        return
    residual = layer.coding.residual_keys.shape[2]
    ring = layer.coding.residual_positions[(positions % residual).long()] == held_positions
    assert ring.any()
    # Within float16's rounding (the full cache's own passes may differ in the last float32 bits), far
    # inside a quantization step.
    in_ring = ring[..., None] & live
    assert (((keys - true_keys).abs() <= true_keys.abs() * 2.0**-10 + 1e-6) | ~in_ring).all()
    if layer.coding.quantizers["keys"].bits == 4:  # where a step is wide enough to tell the ring from the codes
        assert (key_step[in_ring.expand_as(key_step)] > 1e-2).all()


def _decode_checking_each_pass(model, tokenizer, cache, steps: int, seed: int, check) -> None:
    """Prefill ``cache`` with a prompt, then decode ``steps`` random tokens one at a time; after every pass call
    ``check(first_layer, exact_keys, exact_values)`` with the full cache's first-layer keys and values."""
    ids = tokenizer([PROMPT * 2], return_tensors="pt")["input_ids"]
    tokens = torch.randint(5, 300, (1, steps), generator=torch.Generator().manual_seed(seed))
    full = torch.cat([ids, tokens], dim=1)
    exact_keys, exact_values = _exact_first_layer(model, full)
    length = ids.shape[1]
    with torch.no_grad():
        model(ids, past_key_values=cache)
        check(cache.layers[0], exact_keys, exact_values)
        for step in range(steps):
            position = torch.tensor([[length + step]])
            model(full[:, length + step :][:, :1], past_key_values=cache, position_ids=position)
            check(cache.layers[0], exact_keys, exact_values)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("interval", [1, 8])
def test_stored_entries_read_within_a_step_of_the_exact_ones_while_decoding(fresh, bits, interval):
    model, tokenizer = fresh
    cache = CompressedCache(model, budget=48, kv_bits=bits, eviction_interval=interval)
    _decode_checking_each_pass(model, tokenizer, cache, steps=20, seed=1, check=_assert_within_a_step)


def test_a_cropped_tokens_ring_slot_never_stands_for_an_older_token(fresh):
    """Candidates that ``crop`` rejects overwrote ring slots of kept recent tokens: those tokens then read
    their decoded codes, never the rejected candidates' exact entries."""
    model, tokenizer = fresh
    ids = tokenizer([PROMPT], return_tensors="pt")["input_ids"]
    rejected = torch.randint(5, 300, (1, 10), generator=torch.Generator().manual_seed(2))
    exact_keys, exact_values = _exact_first_layer(model, ids)
    cache = CompressedCache(model, compression_ratio=0.0, kv_bits=4, recent_tokens=8)
    with torch.no_grad():
        model(ids, past_key_values=cache)
        positions = torch.arange(ids.shape[1], ids.shape[1] + 10)[None]
        model(rejected, past_key_values=cache, position_ids=positions)
    cache.crop(-10)
    layer = cache.layers[0]
    assert layer.seen == ids.shape[1]
    live_positions = layer.positions()[layer.positions() >= 0]
    assert live_positions.max() == ids.shape[1] - 1
    _ring = layer.coding.residual_positions
    assert not (_ring[(live_positions % 8).long()] == live_positions).any()  # every recent slot was overwritten
    _assert_within_a_step(layer, exact_keys, exact_values, ring_in_use=False)


def test_rows_reordered_by_beam_search_keep_their_codes_and_rings(fresh):
    model, tokenizer = fresh
    batch = tokenizer([PROMPT, PROMPT[:120]], return_tensors="pt", padding=True, padding_side="left")
    cache = CompressedCache(model, budget=40, kv_bits=8)
    with torch.no_grad():
        model(**batch, past_key_values=cache)
    before = [tuple(part.clone() for part in layer.decoded()) for layer in cache.layers]
    cache.reorder_cache(torch.tensor([1, 0]))
    for (keys, values), layer in zip(before, cache.layers, strict=True):
        after_keys, after_values = layer.decoded()
        assert torch.equal(after_keys, keys.flip(0)) and torch.equal(after_values, values.flip(0))


@pytest.mark.parametrize("bits", [16, 8, 5, 4, 3])
def test_generation_over_a_quantized_cache_stays_close_to_the_full_cache(fresh, bits):
    """Logits of a greedy continuation with every token kept: 16 bits match closely, 8 and 4 bits less so,
    and each width errs more than the wider one."""
    model, tokenizer = fresh
    ids = tokenizer([PROMPT], return_tensors="pt")["input_ids"]

    def logits(kv_bits):
        cache = CompressedCache(model, compression_ratio=0.0, kv_bits=kv_bits)
        output = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=12,
                                do_sample=False, output_logits=True, return_dict_in_generate=True,
                                pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        return torch.stack(output.logits), output.sequences

    full, full_tokens = logits(None)
    quantized, tokens = logits(bits)
    error = (quantized - full).abs().max().item()
    assert error <= {16: 1e-3, 8: 3e-2, 5: 0.1, 4: 0.3, 3: 0.5}[bits], error
    if bits == 16:
        assert torch.equal(tokens, full_tokens)


# -- byte sizes -------------------------------------------------------------------------------------


class _Bytes(LogitsProcessor):
    """After each step's forward pass: the bytes held and the full 16-bit cache's bytes for the tokens seen."""

    def __init__(self, cache, model, rows):
        self.cache, self.model, self.rows, self.held = cache, model, rows, []

    def __call__(self, input_ids, scores):
        seen = self.cache.get_seq_length()
        full = full_cache_bytes(self.model, seen, self.rows, element_size=2)
        self.held.append((self.cache.memory_bytes(), full, seen))
        return scores


LONG = " ".join([PROMPT] * 6)


@pytest.mark.parametrize("bits", [None, 16, 8, 5, 4, 3, 2])
@pytest.mark.parametrize("interval", [1, 8])
@pytest.mark.parametrize("fraction", [0.5, 0.2])
def test_memory_fraction_is_never_exceeded_after_a_pass(fresh, bits, interval, fraction):
    model, tokenizer = fresh
    prompts = [LONG, LONG[: len(LONG) // 2]]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    cache = CompressedCache(model, memory_fraction=fraction, kv_bits=bits, eviction_interval=interval)
    check = _Bytes(cache, model, rows=2)
    model.generate(**batch, past_key_values=cache, max_new_tokens=40, do_sample=False,
                   pad_token_id=tokenizer.pad_token_id, logits_processor=[check])  # fmt: skip
    assert len(check.held) == 40
    assert all(held <= fraction * full for held, full, _ in check.held), check.held
    assert cache.kept_tokens > cache.policy.floor  # the size was met by choice, not by the floor


def test_fewer_bits_keep_more_tokens_in_the_same_bytes(fresh):
    model, tokenizer = fresh
    ids = tokenizer([LONG], return_tensors="pt")["input_ids"]
    kept = {}
    for bits in (16, 8, 5, 4, 3, 2):
        cache = CompressedCache(model, memory_fraction=0.5, kv_bits=bits)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        kept[bits] = cache.kept_tokens
    assert kept[16] < kept[8] < kept[5] < kept[4] < kept[3] < kept[2]


@pytest.mark.parametrize("bits", [None, 4])
def test_max_bytes_is_never_exceeded_after_a_pass(fresh, bits):
    model, tokenizer = fresh
    batch = tokenizer([LONG, PROMPT], return_tensors="pt", padding=True, padding_side="left")
    limit = 120_000
    cache = CompressedCache(model, max_bytes=limit, kv_bits=bits)
    check = _Bytes(cache, model, rows=2)
    model.generate(**batch, past_key_values=cache, max_new_tokens=30, do_sample=False,
                   pad_token_id=tokenizer.pad_token_id, logits_processor=[check])  # fmt: skip
    assert all(held <= limit for held, _, _ in check.held), check.held
    assert max(held for held, _, _ in check.held) > limit * 0.7  # it uses what it is given


def test_byte_sizes_are_refused_by_name(fresh):
    model, _ = fresh
    with pytest.raises(ValueError, match=r"memory_fraction must be a number in \(0, 1\]"):
        CompressedCache(model, memory_fraction=0.0)
    with pytest.raises(ValueError, match=r"memory_fraction must be a number in \(0, 1\]"):
        CompressedCache(model, memory_fraction=1.5)
    with pytest.raises(ValueError, match="max_bytes must be an integer >= 1"):
        CompressedCache(model, max_bytes=0)
    with pytest.raises(ValueError, match=r"give exactly one of budget .* got budget and memory_fraction"):
        CompressedCache(model, budget=40, memory_fraction=0.5)


def test_keys_may_keep_more_bits_than_values(fresh):
    model, tokenizer = fresh
    ids = tokenizer([LONG], return_tensors="pt")["input_ids"]
    cache = CompressedCache(model, compression_ratio=0.0, kv_bits=4, key_bits=8)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    layer = cache.layers[0]
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert layer.storage.fields["keys"].dtype == layer.storage.fields["values"].dtype == torch.uint8
    assert layer.storage.read("keys").shape[-1] == head_dim and layer.storage.read("values").shape[-1] == head_dim // 2
    kept = {}
    for bits, key_bits in ((8, None), (4, 8), (4, 5), (4, None)):
        sized = CompressedCache(model, memory_fraction=0.5, kv_bits=bits, key_bits=key_bits)
        with torch.no_grad():
            model(ids, past_key_values=sized)
        kept[(bits, key_bits)] = sized.kept_tokens
    assert kept[(8, None)] < kept[(4, 8)] < kept[(4, 5)] < kept[(4, None)]
    with pytest.raises(ValueError, match=r"key_bits .* needs kv_bits"):
        CompressedCache(model, budget=40, key_bits=8)
    with pytest.raises(ValueError, match="key_bits must be one of 16, 8, 5, 4, 3, 2"):
        CompressedCache(model, budget=40, kv_bits=4, key_bits=6)


@pytest.mark.parametrize(
    ("options", "fraction", "widths"),
    [
        ({}, 0.5, (4, 8)), ({}, 0.45, (4, 8)), ({}, 0.44, (4, 4)), ({}, 0.25, (4, 4)),
        ({"scoring": "attention+novelty"}, 0.3, (4, 4)),
        ({"scoring": "reconstruction", "allocation": "layers"}, 0.25, (4, 8)),
        ({"scoring": "reconstruction", "allocation": "layers"}, 0.2, (4, 8)),
        ({"scoring": "reconstruction", "allocation": "global"}, 0.19, (4, 4)),  # (the earlier spelling)
        ({"scoring": "reconstruction"}, 0.5, (4, 8)), ({"scoring": "reconstruction"}, 0.45, (4, 8)),
        ({"scoring": "reconstruction"}, 0.44, (4, 5)), ({"scoring": "reconstruction"}, 0.1, (4, 5)),
        ({"scoring": "reconstruction"}, 0.099, (4, 4)), ({"scoring": "reconstruction"}, 0.05, (4, 4)),
    ],
)  # fmt: skip
def test_a_byte_sized_cache_told_no_widths_takes_the_documented_ones(fresh, options, fraction, widths):
    # The documented rule, at and on each side of its thresholds: keys in 8 bits and values in 4 from 45%
    # of the full cache's bytes up (also when heads share the budget, the reconstruction default), from 20%
    # when layers share it; when heads share it, keys in 5 bits from 10% to 45%; else both in 4; no exact residual
    # when heads share the budget.
    model, _ = fresh
    cache = CompressedCache(model, memory_fraction=fraction, **options)
    stored = cache.options.storage
    assert (stored.kv_bits, stored.key_bits) == widths
    residual = 0 if options == {"scoring": "reconstruction"} else cache.options.size.recent_tokens
    assert stored.residual_length == residual
    sized_by_hand = CompressedCache(
        model, memory_fraction=fraction, kv_bits=4, key_bits=widths[1], residual_length=residual, **options
    )
    assert cache.policy.entry_bytes == sized_by_hand.policy.entry_bytes  # a token costs what those widths cost


def _windowed_model(family: str) -> torch.nn.Module:
    """A random model with sliding windows of 128 tokens and heads of 32 channels: Gemma 3 with three windowed layers
    and a global one, or Mistral windowed in every layer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    common = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 128, "max_position_embeddings": 1024}
    torch.manual_seed(0)
    if family == "gemma3":
        layers = ["sliding_attention"] * 3 + ["full_attention"]
        config = Gemma3TextConfig(**common, num_hidden_layers=4, layer_types=layers, query_pre_attn_scalar=32)
        return Gemma3ForCausalLM(config).eval()
    return MistralForCausalLM(MistralConfig(**common, num_hidden_layers=2)).eval()


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
@pytest.mark.parametrize(("fraction", "widths"), [(0.45, (4, 8)), (0.15, (4, 5)), (0.149, (2, 4)), (0.12, (2, 4))])
def test_a_byte_sized_cache_with_windows_takes_two_bit_values_below_15_percent(family, fraction, widths):
    """The documented rule on a model with sliding-window layers (reconstruction scores, heads sharing the budget):
    keys in 8 bits from 45% of the bytes, in 5 from 10%, and below 15% keys in 4 and values in 2 (where a model
    without windows keeps values in 4 bits); a generate then never holds more
    than the fraction of the 16-bit cache generate would hold (its windowed layers at their window)."""
    model = _windowed_model(family)
    cache = CompressedCache(model, memory_fraction=fraction, scoring="reconstruction", recent_tokens=8)
    assert (cache.options.storage.kv_bits, cache.options.storage.key_bits) == widths
    prompt = torch.randint(3, 90, (1, 600), generator=torch.Generator().manual_seed(2))
    held = []

    class Held(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen = cache.get_seq_length()
            held.append(cache.memory_bytes() / full_cache_bytes(model, seen, 1, element_size=2, windows=True))
            return scores

    model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache, max_new_tokens=24,
                   do_sample=False, logits_processor=[Held()], pad_token_id=0)  # fmt: skip
    assert len(held) == 24 and max(held) <= fraction, held
    assert min(held) > fraction / 2  # the size was met by choice, not by the floor


def test_five_and_three_bit_codes_need_a_head_size_in_eights():
    """A head size that 5-bit codes cannot pack (12 channels) is refused when the cache is made, naming the setting,
    and a cache sized in bytes, which would pick 5-bit keys, takes 4 bits instead and runs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    for widths in ({"kv_bits": 5}, {"kv_bits": 4, "key_bits": 5}, {"kv_bits": 3}):
        with pytest.raises(ValueError, match=r"head_dim \(12\).*5- and 3-bit codes a multiple of 8"):
            CompressedCache(model, budget=40, **widths)
    cache = CompressedCache(model, memory_fraction=0.25, scoring="reconstruction")
    assert (cache.options.storage.kv_bits, cache.options.storage.key_bits) == (4, 4)
    with torch.no_grad():
        model(torch.randint(3, 64, (1, 120), generator=torch.Generator().manual_seed(1)), past_key_values=cache)
    assert cache.kept_tokens < 120


def test_a_residual_length_given_to_a_byte_sized_cache_is_kept(fresh):
    model, _ = fresh
    options = CompressedCache(model, memory_fraction=0.1, scoring="reconstruction", residual_length=16).options
    assert options.storage.residual_length == 16
    assert CompressedCache(model, budget=40, kv_bits=4, scoring="reconstruction").options.storage.residual_length == 32


@pytest.mark.parametrize(("bits", "held"), [(None, torch.float32), (16, torch.float16), (4, torch.float16)])
def test_waiting_steps_queries_are_held_in_the_storage_width(fresh, bits, held):
    """In a 32-bit model, a cache stored in 16 bits or fewer holds the queries of the decoding steps waiting to be
    scored in 16 bits too, as ``entry_bytes`` counts them."""
    model, tokenizer = fresh
    ids = tokenizer([LONG], return_tensors="pt")["input_ids"]
    cache = CompressedCache(model, budget=48, kv_bits=bits, eviction_interval=8)
    with torch.no_grad():
        model(ids, past_key_values=cache)
        token = ids[:, -1:]
        for step in range(3):
            position = torch.tensor([[ids.shape[1] + step]])
            model(token, past_key_values=cache, position_ids=position)
    layer = cache.layers[0]
    waiting = layer.scorer.waiting.held_tensors()
    assert len(layer.scorer.waiting) >= 1  # steps since the last eviction
    assert {part.dtype for part in waiting} == {held}
    config = model.config
    per_step = (config.num_attention_heads * config.head_dim + 2 * config.head_dim) * held.itemsize
    assert sum(part.numel() * part.element_size() for part in waiting) == len(layer.scorer.waiting) * per_step


# -- the exact residual (residual_length) -----------------------------------------------------------


@pytest.mark.parametrize("residual", [0, 5])
@pytest.mark.parametrize("interval", [1, 8])
def test_a_residual_of_any_length_reads_within_a_step_while_decoding(fresh, residual, interval):
    """With ``residual_length=0`` every stored entry is read from its codes (no ring); with 5, the last five."""
    model, tokenizer = fresh
    cache = CompressedCache(model, budget=48, kv_bits=4, eviction_interval=interval, residual_length=residual)

    def check(layer, exact_keys, exact_values):
        assert layer.coding.residual_keys.shape[2] == residual
        _assert_within_a_step(layer, exact_keys, exact_values, ring_in_use=residual > 0)

    _decode_checking_each_pass(model, tokenizer, cache, steps=12, seed=2, check=check)


def test_the_residual_holds_exactly_its_own_bytes(fresh):
    """Without the residual, the cache holds exactly the ring's keys, values (16 bits) and positions (int32) less."""
    model, tokenizer = fresh
    ids = tokenizer([LONG], return_tensors="pt")["input_ids"]
    held = {}
    for residual in (None, 0):
        cache = CompressedCache(model, budget=48, kv_bits=4, residual_length=residual)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        held[residual] = cache.memory_bytes()
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    ring = cache.options.size.recent_tokens * (2 * config.num_key_value_heads * head_dim * 2 + 4)
    assert held[None] - held[0] == config.num_hidden_layers * ring


@pytest.mark.parametrize("fraction", [0.5, 0.2])
def test_a_byte_size_without_residual_keeps_more_tokens_and_stays_within_it(fresh, fraction):
    model, tokenizer = fresh
    batch = tokenizer([LONG, PROMPT], return_tensors="pt", padding=True, padding_side="left")
    kept = {}
    for residual in (None, 0):
        cache = CompressedCache(model, memory_fraction=fraction, kv_bits=4, residual_length=residual)
        check = _Bytes(cache, model, rows=2)
        model.generate(**batch, past_key_values=cache, max_new_tokens=20, do_sample=False,
                       pad_token_id=tokenizer.pad_token_id, logits_processor=[check])  # fmt: skip
        assert all(held <= fraction * full for held, full, _ in check.held), check.held
        kept[residual] = cache.kept_tokens
    assert kept[0] > kept[None]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_a_bad_residual_length_is_refused_by_name(fresh, bad):
    model, _ = fresh
    with pytest.raises(ValueError, match="residual_length must be an integer >= 0"):
        CompressedCache(model, budget=40, kv_bits=4, residual_length=bad)


# -- coded keys read rotated -------------------------------------------------------------------------


def _passes(model, cache, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The logits of a prefill of ``ids`` and of ``steps`` greedy decoding steps over ``cache``."""
    logits = []
    with torch.no_grad():
        out = model(ids, past_key_values=cache)
        logits.append(out.logits[:, -1])
        for _ in range(steps):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
            logits.append(out.logits[:, -1])
    return logits


@pytest.mark.parametrize("family", ["llama", "phi3", "mistral-sliding", "qwen3", "gemma3"])
@pytest.mark.parametrize(
    "options",
    [
        {"budget": 40, "kv_bits": 4},
        {"budget": 40, "kv_bits": 16, "key_bits": 8, "eviction_interval": 1},
        # (The first layer's refit values are coded again: float rounding of the turn may flip a code.)
        # (A size in tokens: a fraction of memory cannot hold the floor in the sliding family's 10-token windows.)
        {"compression_ratio": 0.5, "kv_bits": 4, "key_bits": 5, "scoring": "reconstruction", "matched_layers": 0},
    ],
)
def test_coded_keys_read_turned_give_what_turning_them_back_gives(family, options):
    """Where a module's queries reach attention as its projection made them (no query norm), its coded keys are
    read rotated, as coded, and its queries are rotated alike: the logits, the kept tokens and their scores are
    those of keys rotated back (the layers told not to read them rotated), and no stored key is rotated back."""
    from tests.families import VOCAB, build_family_model

    model = build_family_model(family)
    ids = torch.randint(3, VOCAB, (1, 72), generator=torch.Generator().manual_seed(0))
    turned_back = CompressedCache(model, **options)
    for layer in turned_back.layers:
        layer.coding.rotated_reads = False
    expected = _passes(model, turned_back, ids, steps=12)
    cache = CompressedCache(model, **options)
    assert all(layer.coding.rotated_reads == (family not in ("qwen3", "gemma3")) for layer in cache.layers)
    decoded = []
    original_decode = Quantizer.decode

    def recording_decode(quantizer, coded, dtype, **kwargs):
        decoded.append(quantizer.rotated and kwargs.get("rotate_back", True))
        return original_decode(quantizer, coded, dtype, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Quantizer, "decode", recording_decode)
        logits = _passes(model, cache, ids, steps=12)
    for got, want in zip(logits, expected, strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    for layer, reference in zip(cache.layers, turned_back.layers, strict=True):
        assert torch.equal(layer.kept_positions(), reference.kept_positions())
        torch.testing.assert_close(layer.scores(), reference.scores(), atol=1e-5, rtol=1e-4)
    # No stored key is rotated back where reads are rotated (on a CPU the C++ operator reads such steps' codes where
    # they lie and decodes nothing in PyTorch); where they are not, every decode rotates the keys back.
    assert any(decoded) == (family in ("qwen3", "gemma3"))
    assert decoded or family not in ("qwen3", "gemma3")
