"""Attention matching (``matched_layers``): the prompt's kept entries of the first layers refit with log-mass biases
and new values.

Oracles: SciPy's nonnegative least squares and NumPy's least squares on the stacked ridge system (the fit); the
first layer's queries and keys taken from the model's own projections and rotated at explicit positions (what the
cache fits against); attention computed by hand, head by head, over the entries the cache stores with their biases
(what every later pass must read); each prompt alone (batches); the storage tensors' sizes (bytes).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import lsq_linear, nnls
from transformers import AttentionInterface

from decodekit.cache import CompressedCache
from decodekit.cache.matching import MASS_RIDGE, MATCH_KEPT_SHARE_LEAST, RIDGE, matched_entries, spread
from decodekit.cache.quantize import rotate as hadamard_rotate
from decodekit.cache.received import waiting_attention
from decodekit.cache.size import full_cache_bytes
from decodekit.cache.storage import storage_bytes
from tests.families import build_family_model
from tests.test_cache_memory import bytes_by_hand
from tests.test_kv_allocation import TEXT, _ids
from tests.tiny import build_model

PROMPT = torch.randint(3, 384, (1, 64), generator=torch.Generator().manual_seed(7))
OTHER = torch.randint(3, 384, (1, 64), generator=torch.Generator().manual_seed(8))
CONTINUATION = torch.randint(3, 384, (1, 6), generator=torch.Generator().manual_seed(9))


@pytest.fixture
def four_layers(tiny):
    _, tokenizer = tiny
    return build_model(tokenizer, num_layers=4), tokenizer


def _cache(model, **options) -> CompressedCache:
    # A fifth of the tokens kept, with a short recent window: the first layer's heads keep at most a quarter of the
    # prompt, which is where they are refit (``MATCH_KEPT_SHARE``).
    settings = {"compression_ratio": 0.8, "recent_tokens": 4, "scoring": "reconstruction", "reconstruction_chunk": 16,
                "replay": "forward", "matched_layers": 1, **options}  # fmt: skip
    return CompressedCache(model, **settings)


def _prefill(model, ids, **options) -> CompressedCache:
    cache = _cache(model, **options)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return cache


def _count(layer, row: int, head: int) -> int:
    """How many entries row ``row``'s KV head ``head`` holds (its segment's first slots)."""
    return int(torch.as_tensor(layer.storage.lengths_host)[row, head])


def _field(layer, name: str, row: int, head: int) -> torch.Tensor:
    """Field ``name`` of the entries row ``row``'s KV head ``head`` holds, in slot order."""
    return layer.storage.read(name, layer.longest)[row, head, : _count(layer, row, head)]


def _ridge_values(attention: np.ndarray, outputs: np.ndarray, own: np.ndarray) -> np.ndarray:
    """The ridge fit of the values as one least-squares system: ``attention`` stacked over ``sqrt(pull) * I``."""
    pull = RIDGE * np.mean(np.sum(attention**2, axis=0))
    count = attention.shape[1]
    system = np.vstack([attention, math.sqrt(pull) * np.eye(count)])
    target = np.vstack([outputs, math.sqrt(pull) * own])
    return np.linalg.lstsq(system, target, rcond=None)[0]


def _mass_system(shares: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """The mass fit as one stacked least-squares system (the shares over ``sqrt(pull) * I``, toward the uniform
    weight), and the uniform weight."""
    pull = MASS_RIDGE * np.mean(np.sum(shares**2, axis=0))
    uniform = 1.0 / shares.sum(axis=1).mean()
    count = shares.shape[1]
    system = np.vstack([shares, math.sqrt(pull) * np.eye(count)])
    target = np.concatenate([np.ones(shares.shape[0]), math.sqrt(pull) * uniform * np.ones(count)])
    return system, target, uniform


def _mass_optimum(shares: np.ndarray) -> tuple[np.ndarray, float]:
    """SciPy's nonnegative least squares of the mass fit, and the optimum's objective."""
    system, target, _ = _mass_system(shares)
    best, residual = nnls(system, target)
    return best, residual


def _mass_objective(shares: np.ndarray, weights: np.ndarray) -> float:
    pull = MASS_RIDGE * np.mean(np.sum(shares**2, axis=0))
    uniform = 1.0 / shares.sum(axis=1).mean()
    return math.sqrt(np.sum((shares @ weights - 1) ** 2) + pull * np.sum((weights - uniform) ** 2))


def test_the_fit_reaches_the_least_squares_optima():
    """The biases' mass fit reaches SciPy's nonnegative least-squares optimum (pulled toward the uniform weight),
    and the values are the ridge solution for those biases; the fitted entries reproduce the full attention outputs
    better than the kept ones alone."""
    generator = torch.Generator().manual_seed(3)
    queries = torch.randn(300, 16, generator=generator) * 0.6
    keys, values = torch.randn(80, 16, generator=generator), torch.randn(80, 16, generator=generator)
    kept = torch.randperm(80, generator=generator)[:20]
    biases, fitted = matched_entries(queries, keys, values, kept)
    attention = torch.softmax(queries @ keys.T, dim=-1).double().numpy()
    shares, outputs = attention[:, kept.numpy()], attention @ values.double().numpy()
    _, optimum = _mass_optimum(shares)
    assert _mass_objective(shares, np.exp(biases.double().numpy())) <= optimum * (1 + 1e-4) + 1e-7
    weighted = shares * np.exp(biases.double().numpy())
    weighted /= weighted.sum(axis=1, keepdims=True)
    expected = _ridge_values(weighted, outputs, values[kept].double().numpy())
    np.testing.assert_allclose(fitted.double().numpy(), expected, atol=2e-4, rtol=1e-3)
    plain = torch.softmax(queries @ keys[kept].T, dim=-1) @ values[kept]
    matched = torch.softmax(queries @ keys[kept].T + biases, dim=-1) @ fitted
    truth = torch.from_numpy(outputs).float()
    assert (matched - truth).norm() < 0.7 * (plain - truth).norm()


@pytest.mark.parametrize("floor", [0.05, 0.5])
def test_a_floor_keeps_every_kept_entry_visible(floor):
    """With a floor, the mass fit reaches SciPy's bounded least-squares optimum with every weight at least
    ``floor`` times the uniform weight (none silenced), where the unbounded fit silences some."""
    generator = torch.Generator().manual_seed(5)
    queries = torch.randn(300, 16, generator=generator) * 0.8
    keys, values = torch.randn(80, 16, generator=generator), torch.randn(80, 16, generator=generator)
    kept = torch.randperm(80, generator=generator)[:60]
    attention = torch.softmax(queries @ keys.T, dim=-1).double().numpy()
    shares = attention[:, kept.numpy()]
    system, target, uniform = _mass_system(shares)
    bounded = lsq_linear(system, target, bounds=(floor * uniform, np.inf), tol=1e-12)
    optimum = math.sqrt(2 * bounded.cost)
    biases, _ = matched_entries(queries, keys, values, kept, floor=floor)
    weights = np.exp(biases.double().numpy())
    assert weights.min() >= floor * uniform * (1 - 1e-5)
    assert _mass_objective(shares, weights) <= optimum * (1 + 1e-4) + 1e-7
    unbounded, _ = matched_entries(queries, keys, values, kept, floor=0.0)
    assert np.exp(unbounded.double().numpy()).min() < 0.01 * uniform  # what the floor is for


def test_spread_takes_evenly_spaced_rows():
    assert spread(torch.arange(100), 5).tolist() == [0, 25, 50, 74, 99]  # rounded evenly spaced indices


def _first_layer_projections(model, ids: torch.Tensor):
    """The first layer's queries ``[heads, length, head_dim]``, rotated at ``length`` plus their position (where a
    replay places them), and its keys and values ``[kv_heads, length, head_dim]``, keys rotated at their positions:
    from the model's own projections and rotary embedding."""
    config, length = model.config, ids.shape[1]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    attention, outputs = model.model.layers[0].self_attn, {}
    hooks = [getattr(attention, f"{part}_proj").register_forward_hook(
        lambda module, args, output, part=part: outputs.setdefault(part, output[0])) for part in "qkv"]  # fmt: skip
    with torch.no_grad():
        model(ids)
        cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(2 * length)[None])
    for hook in hooks:
        hook.remove()

    def rotated(vectors: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        half = vectors.shape[-1] // 2
        turned_half = torch.cat([-vectors[..., half:], vectors[..., :half]], dim=-1)
        return vectors * cos[0, positions] + turned_half * sin[0, positions]

    positions = torch.arange(length)
    queries = rotated(outputs["q"].view(length, heads, head_dim).transpose(0, 1), length + positions)
    keys = rotated(outputs["k"].view(length, kv_heads, head_dim).transpose(0, 1), positions)
    return queries, keys, outputs["v"].view(length, kv_heads, head_dim).transpose(0, 1)


@pytest.mark.parametrize("replay", ["forward", "prompt_queries"])
def test_the_first_layer_is_refit_for_the_replays_queries(replay):
    """Each KV head of the first layer: its kept entries' biases solve the mass fit for the prompt's queries at
    ``length + p`` (as far as SciPy's optimum), its values solve the ridge fit for those biases; deeper layers keep
    theirs as they were."""
    model = build_family_model("llama")
    cache = _prefill(model, PROMPT, replay=replay)
    queries, keys, values = _first_layer_projections(model, PROMPT)
    group = queries.shape[0] // keys.shape[0]
    scaling = 1 / math.sqrt(keys.shape[-1])
    first = cache.layers[0]
    for head in range(first.storage.heads):
        kept = _field(first, "positions", 0, head).long().numpy()
        assert 0 < len(kept) < PROMPT.shape[1]
        reference = queries[head * group : (head + 1) * group].reshape(-1, keys.shape[-1]).double().numpy()
        attention = torch.softmax(torch.from_numpy(reference @ keys[head].double().numpy().T * scaling), dim=-1)
        attention = attention.numpy()
        shares, outputs = attention[:, kept], attention @ values[head].double().numpy()
        weights = np.exp(_field(first, "biases", 0, head).double().numpy())
        _, optimum = _mass_optimum(shares)
        assert _mass_objective(shares, weights) <= optimum * (1 + 1e-3) + 1e-5  # (biases held in float16)
        weighted = shares * weights
        weighted /= weighted.sum(axis=1, keepdims=True)
        expected = _ridge_values(weighted, outputs, values[head, kept].double().numpy())
        np.testing.assert_allclose(_field(first, "values", 0, head).double().numpy(), expected, atol=2e-3, rtol=2e-3)
    assert first.biased and not cache.layers[1].biased
    assert not cache.layers[1].matched and "biases" not in cache.layers[1].storage.fields


def _stored_entries(cache: CompressedCache) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Per layer and KV head of row 0: its entries' keys (rotary applied, not rotated), values and biases, in slot
    order."""
    stored = []
    for layer in cache.layers:
        heads = []
        keys, values = layer.decoded()
        if layer.coding.rotated_reads:
            keys = hadamard_rotate(keys.float())
        for kv_head in range(keys.shape[1]):
            count = _count(layer, 0, kv_head)
            biases = _field(layer, "biases", 0, kv_head).float() if "biases" in layer.storage.fields else None
            heads.append((keys[0, kv_head, :count].float().clone(), values[0, kv_head, :count].float().clone(), biases))
        stored.append(heads)
    return stored


def _attention_by_hand(stored):
    """An attention function that reads, for each KV head, ``stored`` (the cache's entries with their biases) and
    then the pass's own tokens causally: one head at a time, softmax written out."""

    def attend(module, query, key, value, attention_mask, scaling=None, **kwargs):
        heads, kv_heads = query.shape[1], key.shape[1]
        group, new = heads // kv_heads, query.shape[2]
        causal = torch.full((new, new), -math.inf).triu(1)
        outputs = []
        for head in range(heads):
            old_keys, old_values, biases = stored[module.layer_idx][head // group]
            logits = torch.cat([query[0, head] @ old_keys.T, query[0, head] @ key[0, head // group].T], dim=-1)
            logits = logits * scaling
            offsets = torch.zeros(old_keys.shape[0]) if biases is None else biases
            logits = logits + torch.cat([offsets.expand(new, -1), causal], dim=-1)
            every_value = torch.cat([old_values, value[0, head // group]])
            outputs.append(logits.softmax(dim=-1) @ every_value)
        return torch.stack(outputs, dim=1)[None], None

    return attend


@pytest.mark.parametrize(
    ("implementation", "options"),
    [("sdpa", {}), ("eager", {}), ("sdpa", {"kv_bits": 4, "residual_length": 0}), ("sdpa", {"allocation": "layers"}),
     ("sdpa", {"allocation": "uniform", "matched_layers": 2})],
)  # fmt: skip
def test_later_passes_read_the_kept_entries_with_their_biases(implementation, options):
    """A continuation through the cache equals attention written out by hand over what the cache stores, each
    entry's logit plus its bias, head by head: the mask the cache hands the model carries the biases, under SDPA
    and eager attention, heads of their own lengths side by side, coded and rotated keys, every allocation. (Coded
    entries are read from their codes alone here: a pass's own tokens take the exact ring's slots of older ones.)"""
    model = build_family_model("llama")
    model.config._attn_implementation = implementation
    cache = _prefill(model, PROMPT, **options)
    assert cache.layers[0].biased
    stored = _stored_entries(cache)
    length = PROMPT.shape[1]
    positions = torch.arange(length, length + CONTINUATION.shape[1])[None]
    with torch.no_grad():
        logits = model(CONTINUATION, past_key_values=cache, position_ids=positions).logits
    AttentionInterface.register("decodekit_test_by_hand", _attention_by_hand(stored))
    reference = build_family_model("llama")
    reference.config._attn_implementation = "decodekit_test_by_hand"
    with torch.no_grad():
        expected = reference(CONTINUATION, position_ids=positions).logits
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def _biases_by_position(cache: CompressedCache, row: int = 0) -> list[dict[int, float]]:
    """Per KV head of the first layer: each entry's position and bias, for ``row``."""
    first = cache.layers[0]
    maps = []
    for head in range(first.storage.heads):
        positions = _field(first, "positions", row, head).tolist()
        maps.append(dict(zip(positions, _field(first, "biases", row, head).tolist(), strict=True)))
    return maps


@pytest.mark.parametrize("interval", [1, 8])
def test_biases_stay_with_their_entries_through_decoding_reorders_and_crop(interval):
    """Evictions while decoding, a beam reorder and a crop move each bias with its entry, and every entry after
    the prompt has none."""
    model = build_family_model("llama")
    batch = torch.cat([PROMPT, OTHER])
    cache = _prefill(model, batch, eviction_interval=interval)
    fitted = [_biases_by_position(cache, row) for row in (0, 1)]
    assert any(value != 0 for unit in fitted[0] for value in unit.values())
    length, token = batch.shape[1], batch[:, -1:]
    with torch.no_grad():
        for step in range(14):
            if step == 6:
                cache.reorder_cache(torch.tensor([1, 0]))
                fitted.reverse()
            if step == 10:
                cache.crop(-2)
                length -= 2
            logits = model(token, past_key_values=cache, position_ids=torch.full((2, 1), length)).logits
            token, length = logits[:, -1:].argmax(dim=-1), length + 1
            for row in (0, 1):
                for held, prompt in zip(_biases_by_position(cache, row), fitted[row], strict=True):
                    for position, bias in held.items():
                        assert bias == (prompt[position] if position < PROMPT.shape[1] else 0.0)
    assert cache.layers[0].kept < length  # it evicted while decoding


@pytest.mark.parametrize("budget", [8, 10, 30])
def test_rows_of_a_batch_are_refit_as_each_alone(four_layers, budget):
    """Each row keeps and refits what it would alone, down to the budget's floor (4 sinks and a recent window of 4)."""
    model, tokenizer = four_layers
    first, second = _ids(tokenizer), _ids(tokenizer, (TEXT[60:] + TEXT[:60]) * 3)

    def make():
        return _cache(model, compression_ratio=None, budget=budget)

    kwargs = {"do_sample": False, "max_new_tokens": 10}
    alone = [model.generate(ids, past_key_values=make(), **kwargs) for ids in (first, second)]
    cache = make()
    together = model.generate(torch.cat([first, second]), past_key_values=cache, **kwargs)
    assert torch.equal(together, torch.cat(alone))
    caches = [_prefill(model, ids, compression_ratio=None, budget=budget) for ids in (first, second)]
    both = _prefill(model, torch.cat([first, second]), compression_ratio=None, budget=budget)
    kept = [_count(both.layers[0], row, head) for head in range(both.layers[0].storage.heads) for row in range(2)]
    least = math.ceil(MATCH_KEPT_SHARE_LEAST * first.shape[1])
    # At the floor the first layer's heads keep less than MATCH_KEPT_SHARE_LEAST of the prompt and are not refit.
    assert both.layers[0].biased == (budget > 8) == any(count >= least for count in kept)
    layer = both.layers[0]
    for row, single in enumerate(caches):
        alone_layer = single.layers[0]
        for head in range(layer.storage.heads):
            for name in ("positions", "biases", "values"):
                torch.testing.assert_close(_field(layer, name, row, head), _field(alone_layer, name, 0, head),
                                           rtol=0 if name == "positions" else None,
                                           atol=0 if name == "positions" else None)  # fmt: skip


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_a_memory_fraction_holds_with_the_biases(four_layers, kv_bits):
    """The biases are counted: the bytes held stay within the fraction after the prompt and after every step, and
    they are among the tensors the bytes count."""
    model, tokenizer = four_layers
    ids = _ids(tokenizer, TEXT * 6)
    widths = {"kv_bits": kv_bits} if kv_bits else {}
    for fraction in (0.1, 0.05):
        cache = _prefill(model, ids, compression_ratio=None, memory_fraction=fraction, **widths)
        assert cache.layers[0].biased
        biases = cache.layers[0].storage.flat["biases"]
        held = list(cache.layers[0].held_tensors())
        assert any(tensor is biases for tensor in held)
        assert cache.memory_bytes() == sum(storage_bytes(t for layer in cache.layers
                                                         for t in layer.held_tensors()).values())  # fmt: skip
        assert cache.memory_bytes() == bytes_by_hand(cache, model)  # a float16 bias per slot of the first layer
        length, token = ids.shape[1], ids[:, -1:]
        with torch.no_grad():
            for _ in range(8):
                assert cache.memory_bytes() <= fraction * full_cache_bytes(model, length, element_size=2)
                logits = model(token, past_key_values=cache, position_ids=torch.tensor([[length]])).logits
                token, length = logits[:, -1:].argmax(dim=-1), length + 1


def test_a_size_in_bytes_leaves_room_for_the_biases(four_layers):
    """A refit layer's biases take bytes: a fraction leaves room for one per token seen in each refit head, a size
    in bytes for one per kept token."""
    model, _ = four_layers

    def policy(matched, **size):
        return _cache(model, compression_ratio=None, matched_layers=matched, **size).policy

    plain, matched = policy(0, memory_fraction=0.25), policy(1, memory_fraction=0.25)
    entry = matched.entry_bytes
    assert entry.biases_per_seen == 2 * 2 / 8  # 2 bytes in 2 of the 8 (layer, KV head) pairs, per pair
    assert entry.kept == plain.entry_bytes.kept
    expected = math.floor((0.25 * 1000 * entry.full - 1000 * entry.biases_per_seen - entry.fixed) / entry.kept)
    assert matched.target(1000) == expected < plain.target(1000)
    sized = policy(1, max_bytes=100_000)  # its own widths (both in 4 bits: no fraction to pick them by)
    entry = sized.entry_bytes
    assert sized.target(0) == math.floor((100_000 / 8 - entry.fixed) / (entry.kept + 2))


def test_the_exact_ring_holds_the_refit_values(four_layers):
    """Coded entries whose exact copies the ring still holds are read exact: those copies are the refit values,
    which the codes hold to within half a coding step (and the entries' own values, unrefit, are farther)."""
    model, tokenizer = four_layers
    settings = {"kv_bits": 4, "recent_tokens": 16, "compression_ratio": 0.85}
    cache, unrefit = (_prefill(model, _ids(tokenizer), matched_layers=count, **settings) for count in (1, 0))
    farther = 0
    layer, plain = cache.layers[0], unrefit.layers[0]
    assert layer.biased and not plain.biased
    positions = layer.positions()
    assert torch.equal(positions, plain.positions())  # the refit changes no choice
    quantizer = layer.coding.quantizers["values"]
    stop = layer.longest
    scales = layer.storage.read("value_scales", stop)
    coded = {"codes": layer.storage.read("values", stop), "scales": scales,
             "offsets": layer.storage.read("value_offsets", stop)}  # fmt: skip
    from_codes = quantizer.decode(coded, torch.float32)
    read = layer.decoded()[1].float()
    plain_read = plain.decoded()[1].float()
    ring = layer.coding.residual_values.shape[2]
    everywhere = layer.coding.residual_positions[(positions % ring).long()] == positions  # [1, heads, slots]
    half_step = scales.float().repeat_interleave(quantizer.group_size, dim=-1) / 2
    for head in range(layer.storage.heads):
        held, entry = everywhere[0, head], positions[0, head] >= 0
        assert held.sum() == 16
        assert ((read[0, head] - from_codes[0, head]).abs() <= half_step[0, head] + 1e-3)[held].all()
        assert torch.equal(read[0, head][~held & entry], from_codes[0, head][~held & entry])
        farther += int(((plain_read[0, head] - from_codes[0, head]).abs() > half_step[0, head] + 1e-3)[held].any())
    assert farther > 0


def test_scores_after_the_refit_count_the_biases():
    """A decoding step's attention, as the scores receive it, is the softmax of each logit plus its bias."""
    model = build_family_model("llama")
    cache = _prefill(model, PROMPT, eviction_interval=1)
    layer = cache.layers[0]
    assert layer.biased
    count = _count(layer, 0, 0)
    before = list(zip(layer.positions()[0, 0, :count].tolist(), layer.scores()[0, 0, :count].tolist(), strict=True))
    keys, _, biases = _stored_entries(cache)[0][0]
    captured = {}
    projection = model.model.layers[0].self_attn.q_proj
    hook = projection.register_forward_hook(lambda module, args, output: captured.setdefault("q", output))
    length = PROMPT.shape[1]
    with torch.no_grad():
        model(PROMPT[:, -1:], past_key_values=cache, position_ids=torch.tensor([[length]]))
    hook.remove()
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.tensor([[length]]))
    queries = captured["q"].view(config.num_attention_heads, head_dim)[:2]  # the two query heads of KV head 0
    half = head_dim // 2
    queries = queries * cos[0, 0] + torch.cat([-queries[:, half:], queries[:, :half]], dim=-1) * sin[0, 0]
    new_key = layer.decoded()[0][0, 0, layer.positions()[0, 0] == length].float()
    logits = torch.cat([queries @ keys.T, queries @ new_key.T], dim=-1) / math.sqrt(head_dim)
    paid = (logits + torch.cat([biases, torch.zeros(1)])).softmax(dim=-1).mean(dim=0)
    count = _count(layer, 0, 0)
    after = dict(zip(layer.positions()[0, 0, :count].tolist(), layer.scores()[0, 0, :count].tolist(), strict=True))
    assert len(after) >= len(before)  # the step evicted at most one entry
    for index, (position, score) in enumerate(before):  # the stored entries, in slot order (as ``keys``)
        if position in after:
            expected = score * cache.options.scoring.score_decay + paid[index].item()
            assert after[position] == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert after[length] == pytest.approx(paid[-1].item(), rel=1e-4)


def test_waiting_steps_count_the_biases():
    """``waiting_attention`` with biases: each step's softmax over its logits plus the entries' biases (a naive
    loop over steps and heads)."""
    generator = torch.Generator().manual_seed(4)
    queries, keys = torch.randn(1, 4, 3, 8, generator=generator), torch.randn(1, 2, 7, 8, generator=generator)
    biases = torch.randn(1, 2, 7, generator=generator)
    got = waiting_attention(queries, keys, 4, scaling=0.35, decay=0.5, biases=biases.half())
    expected = torch.zeros(1, 2, 7)
    for step in range(3):
        for head in range(4):
            visible = 4 + step + 1
            logits = queries[0, head, step] @ keys[0, head // 2, :visible].T * 0.35
            logits = logits + biases.half()[0, head // 2, :visible]
            expected[0, head // 2, :visible] += logits.softmax(dim=-1) * 0.5 ** (2 - step) / 2
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_sliding_window_layers_are_left_as_they_are():
    """A layer with a sliding window keeps its entries unrefit (a later query cannot see what the fit assumes)."""
    model = build_family_model("gemma3")  # layer 0 slides, layer 1 attends to everything
    cache = _prefill(model, PROMPT, matched_layers=2, recent_tokens=8)
    assert not cache.layers[0].biased and cache.layers[1].biased
    length = PROMPT.shape[1]
    positions = torch.arange(length, length + CONTINUATION.shape[1])[None]
    with torch.no_grad():
        logits = model(CONTINUATION, past_key_values=cache, position_ids=positions).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"matched_layers": -1}, r"matched_layers must be an integer >= 0 or None; got -1"),
        ({"matched_layers": "one"}, r"matched_layers must be an integer >= 0 or None; got 'one'"),
        ({"matched_layers": 1, "scoring": "attention", "allocation": "uniform"},
         r"matched_layers needs scoring='reconstruction'"),
    ],
)  # fmt: skip
def test_bad_matched_layers_are_refused(options, message):
    model = build_family_model("llama")
    with pytest.raises(ValueError, match=message):
        _cache(model, **options)


def test_the_kv_matched_layers_field_reaches_the_cache_and_the_command_line(tiny, tiny_model_dir, capsys):
    """``Strategy(kv_matched_layers=...)`` builds the cache with it, ``--kv-matched-layers`` prints what the library
    gives, and the field is refused where it cannot apply, from the command line without a traceback."""
    from decodekit.cli import main
    from decodekit.generation import generate_text
    from decodekit.strategies import Strategy

    model, tokenizer = tiny
    strategy = Strategy(kv_compression_ratio=0.5, kv_scoring="reconstruction", kv_matched_layers=2)
    assert strategy.plan(model).cache.options.scoring.matched_layers == 2
    prompt = "The class statement creates a new class object and binds it to a name. " * 4
    expected = generate_text(model, tokenizer, [prompt], strategy, max_new_tokens=8)[0]
    code = main(["generate", prompt, "--model", str(tiny_model_dir), "--max-new-tokens", "8", "--kv-ratio", "0.5",
                 "--kv-scoring", "reconstruction", "--kv-matched-layers", "2"])  # fmt: skip
    assert code == 0 and capsys.readouterr().out.rstrip("\n") == expected.rstrip("\n")
    with pytest.raises(ValueError, match="kv_matched_layers applies to kv_scoring=reconstruction"):
        Strategy(kv_budget=40, kv_scoring="attention", kv_matched_layers=1)
    with pytest.raises(ValueError, match="kv_matched_layers must be an integer >= 0"):
        Strategy(kv_budget=40, kv_scoring="reconstruction", kv_matched_layers=-1)
    code = main(["generate", "Hi", "--model", str(tiny_model_dir), "--kv-budget", "40", "--kv-matched-layers", "1"])
    error = capsys.readouterr().err
    assert code == 2 and "error: --kv-matched-layers applies to --kv-scoring" in error and "Traceback" not in error
