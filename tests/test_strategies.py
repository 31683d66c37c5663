"""Strategy: validation, the generate kwargs it yields, and what generate does with them."""

from __future__ import annotations

import pytest
import torch

from decodekit import Strategy
from decodekit.generation import encode_prompts


def test_greedy_is_the_default():
    assert Strategy().generate_kwargs() == {"do_sample": False}
    assert Strategy().label == "greedy"


def test_sampling_names_every_filter_so_model_defaults_cannot_sneak_in():
    kwargs = Strategy(temperature=0.7).generate_kwargs()
    assert kwargs == {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}


RESIDUAL_NEEDS_CODES = "kv_residual_length applies to keys and values stored in 8, 5, 4, 3 or 2"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": 0}, "temperature must be"),
        ({"temperature": float("nan")}, "temperature must be"),
        ({"temperature": -1.0}, "temperature must be"),
        ({"top_k": 0}, "top_k must be"),
        ({"top_k": 2.5}, "top_k must be"),
        ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\]"),
        ({"do_sample": False, "temperature": 0.5}, "only apply when sampling"),
        ({"num_beams": 0}, r"num_beams must be an integer in \[1, 256\]"),
        ({"num_beams": 2, "temperature": 0.5}, "does not sample"),
        ({"num_beams": 2, "length_normalization": "log"}, "length_normalization must be one of"),
        ({"num_beams": 2, "length_alpha": -1.0}, "length_alpha must be"),
        ({"num_beams": 2, "early_stopping": "soon"}, "early_stopping must be"),
        ({"length_alpha": 0.6}, "length_alpha applies to num_beams: set num_beams too"),
        ({"kv_budget": 8}, "kv_budget must be an integer >= 36"),
        ({"kv_compression_ratio": 1.0}, r"kv_compression_ratio must be a number in \[0, 1\)"),
        ({"kv_budget": 64, "kv_compression_ratio": 0.5}, "exactly one of kv_budget"),
        ({"kv_budget": 64, "kv_eviction_interval": 0}, "kv_eviction_interval must be an integer >= 1"),
        ({"kv_budget": 64, "kv_eviction_interval": 2.5}, "kv_eviction_interval must be an integer >= 1"),
        ({"kv_eviction_interval": 4}, "kv_eviction_interval applies to a compressed cache: set kv_budget"),
        ({"kv_bits": 4, "kv_residual_length": -1}, "kv_residual_length must be an integer >= 0"),
        ({"kv_bits": 4, "kv_residual_length": True}, "kv_residual_length must be an integer >= 0"),
        ({"kv_budget": 64, "kv_residual_length": 8}, RESIDUAL_NEEDS_CODES),
        ({"kv_bits": 16, "kv_residual_length": 8}, RESIDUAL_NEEDS_CODES),
        ({"kv_memory_fraction": 0.5, "kv_bits": 16, "kv_residual_length": 8}, RESIDUAL_NEEDS_CODES),
        ({"kv_bits": 5, "kv_residual_length": -1}, "kv_residual_length must be an integer >= 0"),
    ],
)
def test_bad_fields_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        Strategy(**fields)


def test_round_trips_through_a_dict_and_rejects_unknown_keys():
    strategy = Strategy(name="nucleus", temperature=0.9, top_p=0.95)
    assert Strategy.from_dict(strategy.to_dict()) == strategy
    with pytest.raises(ValueError, match="unknown Strategy field"):
        Strategy.from_dict({"temprature": 0.9})


def _generate(model, tokenizer, strategy, seed=None, **extra):
    batch = encode_prompts(tokenizer, ["Tell me about the sea"])
    if seed is not None:
        torch.manual_seed(seed)
    kwargs = strategy.generate_kwargs(model) if strategy is not None else {}
    output = model.generate(**batch, max_new_tokens=12, **kwargs, **extra)
    return output[0, batch["input_ids"].shape[1] :].tolist()


def test_greedy_strategy_matches_plain_greedy_generate(tiny):
    model, tokenizer = tiny
    assert _generate(model, tokenizer, Strategy()) == _generate(model, tokenizer, None, do_sample=False)


def test_top_k_one_is_greedy(tiny):
    model, tokenizer = tiny
    greedy = _generate(model, tokenizer, Strategy())
    assert all(_generate(model, tokenizer, Strategy(top_k=1), seed=seed) == greedy for seed in range(3))


def test_unset_filters_stay_off_even_when_the_model_config_sets_them(tiny):
    model, tokenizer = tiny
    greedy = _generate(model, tokenizer, Strategy())
    saved = model.generation_config.top_k
    model.generation_config.top_k = 1  # as a checkpoint's generation_config.json might
    try:
        samples = [_generate(model, tokenizer, Strategy(temperature=1.0), seed=seed) for seed in range(4)]
    finally:
        model.generation_config.top_k = saved
    assert any(sample != greedy for sample in samples)


def test_beam_strategy_names_the_decoder_and_only_the_settings_given():
    from decodekit.decoders import beam_search

    kwargs = Strategy(num_beams=4, length_normalization="gnmt", length_alpha=0.6).generate_kwargs()
    assert kwargs == {
        "do_sample": False,
        "custom_generate": beam_search,
        "num_beams": 4,
        "length_normalization": "gnmt",
        "length_alpha": 0.6,
    }
    strategy = Strategy(num_beams=2, early_stopping="never", staged_penalty="1:1.5")
    assert strategy.label == "beam(num_beams=2, early_stopping=never, staged_penalty=1:1.5)"
    assert Strategy.from_dict(strategy.to_dict()) == strategy


def test_a_cache_strategy_builds_a_fresh_compressed_cache_per_call(tiny):
    from decodekit.cache import CompressedCache

    model, _ = tiny
    strategy = Strategy(kv_budget=64)
    first, second = strategy.generate_kwargs(model), strategy.generate_kwargs(model)
    assert isinstance(first["past_key_values"], CompressedCache)
    assert first["past_key_values"] is not second["past_key_values"]
    assert first["past_key_values"].options.size.budget == 64
    with pytest.raises(ValueError, match="need the model"):
        strategy.generate_kwargs()


@pytest.mark.parametrize(
    ("fields", "interval", "residual"),
    [
        ({"kv_budget": 64}, 8, 32),  # the cache's own defaults (the residual window: the recent tokens)
        ({"kv_budget": 64, "kv_eviction_interval": 1}, 1, 32),
        ({"kv_budget": 64, "kv_bits": 8, "kv_eviction_interval": 5, "kv_residual_length": 0}, 5, 0),
        ({"kv_bits": 4, "kv_residual_length": 3}, 8, 3),  # every token kept, in 4 bits
        ({"kv_memory_fraction": 0.25, "kv_residual_length": 16}, 8, 16),
    ],
)
def test_the_eviction_interval_and_residual_fields_reach_the_cache(tiny, fields, interval, residual):
    model, _ = tiny
    options = Strategy(**fields).generate_kwargs(model)["past_key_values"].options
    assert (options.size.eviction_interval, options.storage.residual_length) == (interval, residual)
