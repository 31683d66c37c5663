"""CompressedCache against DynamicCache, eager attention weights and masked full forward passes."""

from __future__ import annotations

import copy
import math
from functools import partial

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, LlamaForCausalLM, LogitsProcessor

from decodekit.cache import CompressedCache, unbind
from decodekit.cache.storage import storage_bytes
from decodekit.decoders import beam_search
from tests.tiny import build_model

PROMPTS = ["def foo(bar):\n    return bar", "The class statement creates a new class object", "x = 1"]


@pytest.fixture
def fresh(tiny):
    """A fresh copy of the tiny model, so that hooks bound in one test never reach another."""
    _, tokenizer = tiny
    return build_model(tokenizer), tokenizer


def _batch(tokenizer, prompts=PROMPTS):
    return tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")


def _greedy(model, tokenizer, batch, cache=None, **kwargs):
    kwargs.setdefault("max_new_tokens", 24)
    if cache is not None:
        kwargs["past_key_values"] = cache
    return model.generate(**batch, do_sample=False, pad_token_id=tokenizer.pad_token_id, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of budget"),
        ({"budget": 64, "compression_ratio": 0.5}, "exactly one of budget"),
        ({"budget": 30}, r"budget must be an integer >= 36 \(sink_tokens \+ recent_tokens = 4 \+ 32\)"),
        ({"budget": 64.0}, "budget must be an integer"),
        ({"compression_ratio": 1.0}, r"compression_ratio must be a number in \[0, 1\)"),
        ({"compression_ratio": -0.1}, r"compression_ratio must be a number in \[0, 1\)"),
        ({"compression_ratio": float("nan")}, "compression_ratio must be"),
        ({"budget": 64, "recent_tokens": 0}, "recent_tokens must be an integer >= 1"),
        ({"budget": 64, "sink_tokens": -1}, "sink_tokens must be an integer >= 0"),
        ({"budget": 64, "observation_window": 0}, "observation_window must be an integer >= 1"),
        ({"budget": 64, "pool_kernel": 4}, "pool_kernel must be odd"),
        ({"budget": 64, "score_decay": 1.5}, r"score_decay must be a number in \[0, 1\]"),
    ],
)
def test_bad_settings_are_named(fresh, kwargs, message):
    model, _ = fresh
    with pytest.raises(ValueError, match=message):
        CompressedCache(model, **kwargs)


def test_a_model_without_supported_attention_is_refused_naming_its_type():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="does not support model type 'gpt2'"):
        CompressedCache(model, budget=64)


def test_a_cache_built_for_another_model_is_refused(fresh, tiny):
    model, tokenizer = fresh
    other = build_model(tokenizer, seed=1)
    CompressedCache(other, budget=64)  # binds the other model too
    with pytest.raises(ValueError, match="only inside a forward pass of the model it was built with"):
        _greedy(model, tokenizer, _batch(tokenizer), CompressedCache(other, budget=64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_budget_above_the_length_gives_the_same_tokens_as_dynamic_cache(fresh, dtype):
    model, tokenizer = fresh
    model = model.to(dtype)
    batch = _batch(tokenizer)
    full = _greedy(model, tokenizer, batch)
    cache = CompressedCache(model, budget=256)
    assert torch.equal(_greedy(model, tokenizer, batch, cache), full)
    assert cache.get_seq_length() == full.shape[1] - 1  # logical: the last token is never fed back


class _RecordCache(LogitsProcessor):
    def __init__(self, cache):
        self.cache = cache
        self.kept, self.slots, self.seen = [], [], []

    def __call__(self, input_ids, scores):
        self.seen.append(self.cache.get_seq_length())
        self.kept.append([layer.kept for layer in self.cache.layers])
        self.slots.append([layer.storage.capacity for layer in self.cache.layers])
        return scores


def _expected_kept(prompt: int, steps: int, budget: int, interval: int, floor: int) -> list[int]:
    """The spec, step by step: the prompt's pass evicts to the budget; a decoding step that goes over
    it evicts down to ``budget - interval + 1`` (never below the sinks and recent window)."""
    kept = [min(prompt, budget)]
    for _ in range(steps):
        live = kept[-1] + 1
        kept.append(live if live <= budget else max(budget - interval + 1, floor))
    return kept


@pytest.mark.parametrize("interval", [1, 8])
def test_a_budget_holds_after_prefill_and_throughout_decoding(fresh, interval):
    model, tokenizer = fresh
    budget = 40
    cache = CompressedCache(model, budget=budget, recent_tokens=8, eviction_interval=interval)
    recorder = _RecordCache(cache)
    batch = _batch(tokenizer)
    output = _greedy(model, tokenizer, batch, cache, max_new_tokens=80, logits_processor=[recorder])
    assert output.shape[1] == batch["input_ids"].shape[1] + 80
    assert recorder.seen[-1] > budget
    # ``kept`` is the most any row keeps: a shorter row may hold more than the longest one just after
    # the longest evicted down to ``budget - interval + 1``.
    per_row = [_expected_kept(int(real), 79, budget, interval, floor=4 + 8) for real in batch["attention_mask"].sum(1)]
    expected = [max(step) for step in zip(*per_row, strict=True)]
    assert [kept[0] for kept in recorder.kept] == expected
    assert all(kept == [kept[0]] * len(cache.layers) for kept in recorder.kept)
    assert all(max(slots) <= budget + 1 for slots in recorder.slots)  # + the slot the next token takes
    assert cache.get_seq_length() == batch["input_ids"].shape[1] + 79
    # By hand: per slot fp32 keys and values, a position, a score and a value norm; one scratch slot; each segment's
    # start and length (int64), each row's padding (int64) and the count of tokens seen (int64). Nothing else is held
    # between steps (no waiting steps: a padded batch scores every step).
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    rows, heads = batch["input_ids"].shape[0], config.num_key_value_heads
    per_slot = 2 * head_dim * 4 + 4 + 4 + 4
    expected = sum((rows * heads * layer.storage.capacity + 1) * per_slot + 2 * rows * heads * 8 + rows * 8 + 8
                   for layer in cache.layers)  # fmt: skip  (+ the count of tokens seen, on the device: int64)
    assert cache.memory_bytes() == expected


@pytest.mark.parametrize(
    ("size", "interval"),
    [
        ({"budget": 36}, 8), ({"budget": 287}, 8), ({"budget": 288}, 9), ({"budget": 2047}, 63),
        ({"budget": 2048}, 64), ({"budget": 100_000}, 64), ({"compression_ratio": 0.9}, 8),
        ({"memory_fraction": 0.25}, 8), ({"max_bytes": 10**9}, 8),
        ({"memory_fraction": 0.25, "scoring": "reconstruction"}, 1),  # heads share the bytes: byte_sized_interval
        ({"max_bytes": 10**9, "scoring": "reconstruction", "allocation": "global"}, 8),
    ],
)  # fmt: skip
def test_the_default_eviction_interval_is_a_32nd_of_a_fixed_budget_from_8_to_64_else_by_size(fresh, size, interval):
    model, _ = fresh
    assert CompressedCache(model, **size).options.size.eviction_interval == interval
    assert CompressedCache(model, **size, eviction_interval=3).options.size.eviction_interval == 3  # given: kept


def test_the_default_interval_decodes_as_that_interval_given(fresh):
    """A 320-token budget evicts 10 tokens at once by default: the same kept counts (the spec, step by step)
    and the same tokens as ``eviction_interval=10``."""
    model, tokenizer = fresh
    budget, steps = 320, 40
    batch = _batch(tokenizer, [" ".join(PROMPTS * 12)])
    length = batch["input_ids"].shape[1]
    assert length > budget
    runs = []
    for settings in ({}, {"eviction_interval": 10}):
        cache = CompressedCache(model, budget=budget, **settings)
        recorder = _RecordCache(cache)
        output = _greedy(model, tokenizer, batch, cache, max_new_tokens=steps, logits_processor=[recorder])
        runs.append((output, [kept[0] for kept in recorder.kept], [layer.kept_positions() for layer in cache.layers]))
    (default, kept, positions), (given, kept_given, positions_given) = runs
    assert kept == _expected_kept(length, steps - 1, budget, 10, floor=36) == kept_given
    assert torch.equal(default, given)
    assert all(torch.equal(a, b) for a, b in zip(positions, positions_given, strict=True))


@pytest.mark.parametrize("interval", [1, 8])
def test_decoding_one_prompt_holds_budget_plus_one_slots_and_matches_the_padded_path(fresh, interval):
    """A prompt alone decodes without a mask; in a left-padded batch the same row decodes beside a row of another
    length, under a mask. Both must keep the same tokens and give the same text."""
    model, tokenizer = fresh
    budget, prompt = 40, " ".join(PROMPTS * 2)
    make = partial(CompressedCache, model, budget=budget, recent_tokens=8, eviction_interval=interval)
    alone_cache, batch_cache = make(), make()
    recorder = _RecordCache(alone_cache)
    alone = _greedy(model, tokenizer, _batch(tokenizer, [prompt]), alone_cache, max_new_tokens=60,
                    logits_processor=[recorder])  # fmt: skip
    batched = _greedy(model, tokenizer, _batch(tokenizer, [prompt, "x"]), batch_cache, max_new_tokens=60)
    assert torch.equal(alone[0], batched[0, -alone.shape[1] :])
    for ours, theirs in zip(alone_cache.layers, batch_cache.layers, strict=True):
        kept_alone, kept_batched = ours.kept_positions()[0], theirs.kept_positions()[0]
        # The batch's rows keep different counts; the fuller row ("x") pads this one's list with -1.
        assert kept_alone.tolist() == kept_batched[:, -kept_alone.shape[-1] :].tolist()
        assert (kept_batched[:, : -kept_alone.shape[-1]] == -1).all()
    assert all(max(slots) <= budget + 1 for slots in recorder.slots)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_slot = 2 * head_dim * 4 + 4 + 4 + 4  # fp32 keys and values; position, score, value norm
    entries = sum(
        storage_bytes(tensor for layer in alone_cache.layers for tensor in layer.storage.flat.values()).values()
    )
    assert entries <= config.num_hidden_layers * (config.num_key_value_heads * (budget + 1) + 1) * per_slot
    # Beyond the entries: each segment's start and length, the row's padding and the count of tokens seen (int64
    # each) and at most
    # ``interval - 1`` waiting steps' queries (fp32, every query head) with their rotation (cos and sin, shared by the
    # layers).
    waiting = (interval - 1) * (config.num_hidden_layers * config.num_attention_heads + 2) * head_dim * 4
    counts = config.num_hidden_layers * (2 * config.num_key_value_heads * 8 + 8 + 8)  # (+ the count of tokens seen)
    assert alone_cache.memory_bytes() - entries <= counts + waiting


@pytest.mark.parametrize("interval", [1, 4])
def test_a_ratio_keeps_that_share_of_the_tokens_seen(fresh, interval):
    model, tokenizer = fresh
    ids = _batch(tokenizer, [" ".join(PROMPTS * 6)])["input_ids"]
    length = ids.shape[1]
    cache = CompressedCache(model, compression_ratio=0.5, sink_tokens=2, recent_tokens=8, eviction_interval=interval)
    model(ids, past_key_values=cache)
    assert cache.get_seq_length() == length
    expected = math.ceil(0.5 * length)
    assert cache.kept_tokens == expected
    for step in range(10):
        position = torch.tensor([[length + step]])
        model(ids[:, -1:], past_key_values=cache, position_ids=position)
        target = math.ceil(0.5 * (length + step + 1))  # the spec: over the target, evict to target - interval + 1
        expected = expected + 1 if expected + 1 <= target else target - interval + 1
        assert cache.kept_tokens == expected
    if interval == 1:
        assert cache.kept_tokens == math.ceil(0.5 * (length + 10))


def test_scores_equal_the_eager_attention_each_token_receives(tiny, tiny_model_dir):
    _, tokenizer = tiny
    eager = LlamaForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    ids = _batch(tokenizer, [PROMPTS[1] + " " + PROMPTS[0]])["input_ids"]
    length = ids.shape[1]
    with torch.no_grad():
        attentions = eager(ids, output_attentions=True).attentions
        cache = CompressedCache(eager, compression_ratio=0.0, recent_tokens=1, sink_tokens=0)
        eager(ids, past_key_values=cache)
    seen_by = torch.arange(length, 0, -1, dtype=torch.float32)  # key k is seen by length - k queries
    kv_heads = eager.config.num_key_value_heads
    for layer, weights in zip(cache.layers, attentions, strict=True):
        per_query_head = weights[0].sum(dim=1) / seen_by  # [heads, keys]
        expected = per_query_head.view(kv_heads, -1, length).mean(dim=1)
        torch.testing.assert_close(layer.scores()[0], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("new_tokens", [1, 2])
def test_after_eviction_new_tokens_see_exactly_the_kept_tokens_and_each_other(fresh, new_tokens):
    """Oracle: a full forward pass whose 4D mask hides the evicted tokens from the new queries."""
    model, tokenizer = fresh
    ids = _batch(tokenizer, [" ".join(PROMPTS * 3)])["input_ids"]
    ids = torch.cat([ids, ids.flip(0)])[:, :60]  # two rows, no padding
    sinks, recent = 3, 9
    cache = CompressedCache(model, budget=sinks + recent, sink_tokens=sinks, recent_tokens=recent)
    following = torch.tensor([[17, 5], [42, 9]])[:, :new_tokens]
    positions = torch.arange(60, 60 + new_tokens).expand(2, -1)
    with torch.no_grad():
        model(ids, past_key_values=cache)
        cached = model(following, past_key_values=cache, position_ids=positions).logits
        total = 60 + new_tokens
        mask = torch.tril(torch.ones(total, total, dtype=torch.bool))
        mask[60:, sinks : 60 - recent] = False  # what the cache evicted after the prompt
        full = torch.cat([ids, following], dim=1)
        reference = model(full, attention_mask=mask.expand(2, 1, total, total)).logits[:, 60:]
    torch.testing.assert_close(cached, reference, atol=1e-5, rtol=1e-4)
    kept = {tuple(heads) for layer in cache.layers for row in layer.kept_positions().tolist() for heads in row}
    assert kept == {(*range(sinks), *range(total - recent, total))}


LONG = "The class statement creates a new class object " * 12


def _alone_and_batched(model, tokenizer, prompts, make_cache, **kwargs):
    """Per prompt: (new tokens alone, new tokens in the left-padded batch), plus the two caches' kept positions."""
    batch = _batch(tokenizer, prompts)
    width = batch["input_ids"].shape[1]
    batched_cache = make_cache()
    batched = _greedy(model, tokenizer, batch, batched_cache, **kwargs)[:, width:]
    results = []
    for row, prompt in enumerate(prompts):
        single = _batch(tokenizer, [prompt])
        cache = make_cache()
        alone = _greedy(model, tokenizer, single, cache, **kwargs)[0, single["input_ids"].shape[1] :]
        pads = width - single["input_ids"].shape[1]
        results.append((alone, batched[row], cache, pads))
    return results, batched_cache


@pytest.mark.parametrize(
    "settings",
    [{"compression_ratio": 0.5}, {"budget": 40, "recent_tokens": 8}, {"budget": 48, "sink_tokens": 2}],
    ids=["ratio", "budget", "budget-default-recent"],
)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("scoring", ["attention", "attention+novelty"])
def test_each_row_of_a_padded_batch_decodes_what_it_decodes_alone(fresh, settings, attention, scoring):
    """Padding is not content: a row keeps, scores and attends to what it would alone."""
    model, tokenizer = fresh
    model.set_attn_implementation(attention)
    prompts = ["def foo", LONG, PROMPTS[1]]
    results, batched_cache = _alone_and_batched(
        model, tokenizer, prompts, lambda: CompressedCache(model, scoring=scoring, **settings), max_new_tokens=16
    )
    for alone, batched, _, _ in results:
        assert torch.equal(batched, alone)
    assert not any(layer.scores().isnan().any() for layer in batched_cache.layers)
    # The kept positions of each row, shifted by its padding, are those it keeps alone; the rest is -1.
    for row, (_, _, cache, pads) in enumerate(results):
        for batched_layer, alone_layer in zip(batched_cache.layers, cache.layers, strict=True):
            alone_positions = alone_layer.kept_positions()[0]
            kept = batched_layer.kept_positions()[row]
            unused = kept.shape[-1] - alone_positions.shape[-1]
            assert torch.equal(kept[:, unused:] - pads, alone_positions)
            assert bool((kept[:, :unused] == -1).all())


def test_novelty_scoring_keeps_the_best_of_two_rankings(fresh):
    """Oracle: a loop over each head's tokens that ranks them by attention (times value norm) and by key
    novelty (negative cosine to the mean key), takes each token's better rank (ties: the other rank,
    then attention) and keeps the sinks, the recent tokens and the best of the rest."""
    model, tokenizer = fresh
    ids = _batch(tokenizer, [LONG])["input_ids"]
    length, sinks, recent = ids.shape[1], 2, 6
    keep_all = CompressedCache(model, compression_ratio=0.0, sink_tokens=sinks, recent_tokens=recent)
    ours = CompressedCache(
        model, compression_ratio=0.5, sink_tokens=sinks, recent_tokens=recent, scoring="attention+novelty"
    )
    with torch.no_grad():
        model(ids, past_key_values=keep_all)
        model(ids, past_key_values=ours)
    target = math.ceil(0.5 * length)
    for full, layer in zip(keep_all.layers, ours.layers, strict=True):
        keys_read = full.decoded()[0]
        for head in range(keys_read.shape[1]):
            keys = keys_read[0, head].double()
            attention = full.scorer.importance(full, full.longest)[0, head].tolist()
            mean = keys.mean(dim=0)
            novelty = (-(keys @ mean) / (keys.norm(dim=1) * mean.norm()).clamp(min=1e-8)).tolist()
            rank_a = {token: rank for rank, token in enumerate(sorted(range(length), key=lambda t: attention[t]))}
            rank_n = {token: rank for rank, token in enumerate(sorted(range(length), key=lambda t: novelty[t]))}
            order = sorted(
                range(length),
                key=lambda t: (max(rank_a[t], rank_n[t]), min(rank_a[t], rank_n[t]), rank_a[t]),
                reverse=True,
            )
            protected = [*range(sinks), *range(length - recent, length)]
            rest = [token for token in order if token not in protected][: target - len(protected)]
            assert layer.kept_positions()[0, head].tolist() == sorted(protected + rest)


def test_a_budget_below_the_padding_plus_protected_tokens_keeps_the_real_tokens(fresh):
    """A budget between a row's padding and padding + sinks + recent once decoded garbage for that row."""
    model, tokenizer = fresh
    prompts = [PROMPTS[2], LONG]
    pads = _batch(tokenizer, prompts)["input_ids"].shape[1] - _batch(tokenizer, [PROMPTS[2]])["input_ids"].shape[1]
    budget = 36  # the default sinks + recent window, far below this batch's padding
    assert pads > budget
    results, batched_cache = _alone_and_batched(
        model, tokenizer, prompts, lambda: CompressedCache(model, budget=budget), max_new_tokens=16
    )
    for alone, batched, _, _ in results:
        assert torch.equal(batched, alone)
    for layer in batched_cache.layers:
        assert layer.storage.capacity <= budget + 1  # padding takes no room beyond the budget's one free slot
        assert int(layer.storage.lengths_host.max()) <= budget


@pytest.mark.parametrize("decoder", ["built-in", "decodekit"])
def test_beam_search_on_a_padded_batch_gives_each_row_its_result_alone(fresh, decoder):
    model, tokenizer = fresh
    kwargs = {"num_beams": 3, "max_new_tokens": 12}
    if decoder == "decodekit":
        kwargs["custom_generate"] = beam_search
    results, _ = _alone_and_batched(
        model, tokenizer, ["x = 1", LONG], lambda: CompressedCache(model, budget=40, recent_tokens=8), **kwargs
    )
    for alone, batched, _, _ in results:
        assert torch.equal(batched, alone)


def test_direct_update_says_what_is_required(fresh):
    model, _ = fresh
    cache = CompressedCache(model, budget=64)
    keys = torch.zeros(1, 2, 3, 16)
    with pytest.raises(ValueError, match=r"only inside a forward pass of the model it was built with.*cache.update"):
        cache.update(keys, keys, 0)


@pytest.mark.parametrize("assistance", ["prompt_lookup", "assistant_model"])
def test_assisted_generation_equals_dynamic_cache_above_the_length(fresh, assistance):
    model, tokenizer = fresh
    batch = _batch(tokenizer, [PROMPTS[0] * 4])
    if assistance == "prompt_lookup":
        kwargs = {"prompt_lookup_num_tokens": 3}
    else:
        kwargs = {"assistant_model": build_model(tokenizer, seed=3, num_layers=1)}
    reference = _greedy(model, tokenizer, batch, max_new_tokens=30)
    cache = CompressedCache(model, budget=512)
    assert torch.equal(_greedy(model, tokenizer, batch, cache, max_new_tokens=30, **kwargs), reference)
    assert cache.get_seq_length() == reference.shape[1] - 1


def test_after_a_crop_the_next_token_sees_what_a_masked_full_forward_shows_it(fresh):
    """Oracle: a full forward pass whose 4D mask shows each query exactly what the cache held for it."""
    model, tokenizer = fresh
    ids = _batch(tokenizer, [" ".join(PROMPTS * 3)])["input_ids"][:, :60]
    sinks, recent = 3, 9
    cache = CompressedCache(model, budget=sinks + recent, sink_tokens=sinks, recent_tokens=recent)
    extra, following = torch.tensor([[7, 8, 9]]), torch.tensor([[11]])
    with torch.no_grad():
        model(ids, past_key_values=cache)  # keeps the sinks and positions 51..59
        model(extra, past_key_values=cache, position_ids=torch.arange(60, 63)[None])  # keeps 54..62
        cache.crop(-2)  # forget positions 61 and 62, as assisted generation does with rejected candidates
        assert cache.get_seq_length() == 61
        cached = model(following, past_key_values=cache, position_ids=torch.tensor([[61]])).logits[:, -1]
        mask = torch.tril(torch.ones(62, 62, dtype=torch.bool))
        mask[60, sinks : 60 - recent] = False  # token 60 was in the pass after the prompt's eviction
        mask[61, sinks : 63 - recent] = False  # token 61 comes after the extra pass's eviction
        full = torch.cat([ids, extra[:, :1], following], dim=1)
        reference = model(full, attention_mask=mask.expand(1, 1, 62, 62)).logits[:, -1]
    torch.testing.assert_close(cached, reference, atol=1e-5, rtol=1e-4)
    kept = {tuple(heads) for layer in cache.layers for heads in layer.kept_positions()[0].tolist()}
    assert kept == {(*range(sinks), *range(63 - recent, 62))}


def test_hooks_leave_other_caches_bit_identical(fresh):
    model, tokenizer = fresh
    ids = _batch(tokenizer)["input_ids"]
    with torch.no_grad():
        before = [model(ids).logits, model(ids, past_key_values=DynamicCache()).logits]
        CompressedCache(model, budget=64)
        after = [model(ids).logits, model(ids, past_key_values=DynamicCache()).logits]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    cache = CompressedCache(model, budget=64)
    unbind(model)
    with pytest.raises(ValueError, match="only inside a forward pass of the model it was built with"):
        model(ids, past_key_values=cache)


def _observed_modules(model) -> list[torch.nn.Module]:
    attention = [layer.self_attn for layer in model.model.layers]
    return attention + [module.q_proj for module in attention]


def test_binding_wraps_forward_without_hooks(fresh):
    """The attention modules and their query projections keep PyTorch's plain call path (no hook), and
    unbind gives them their own forward back."""
    model, tokenizer = fresh
    batch = _batch(tokenizer, PROMPTS[:1])
    CompressedCache(model, budget=36)
    observed = _observed_modules(model)
    assert all(not module._forward_hooks and not module._forward_pre_hooks for module in observed)
    assert all("forward" in module.__dict__ for module in observed)
    with_cache = _greedy(model, tokenizer, batch, CompressedCache(model, budget=36))
    unbind(model)
    assert all("forward" not in module.__dict__ for module in observed)
    assert torch.equal(_greedy(model, tokenizer, batch, CompressedCache(model, budget=36)), with_cache)


def test_only_a_replaying_cache_hooks_the_model(fresh):
    """The model's own forward gets a hook (PyTorch's slower hooked path for every call) only once a cache that
    replays the prompt is built on it; that cache still replays, and unbind removes the hook."""
    model, tokenizer = fresh
    batch = _batch(tokenizer, PROMPTS[:1])
    CompressedCache(model, budget=36)
    assert not model._forward_hooks
    replaying = CompressedCache(model, budget=36, scoring="reconstruction")
    assert len(model._forward_hooks) == 1
    CompressedCache(model, budget=36, scoring="reconstruction")
    assert len(model._forward_hooks) == 1  # never hooked twice
    _greedy(model, tokenizer, batch, replaying)
    assert not replaying.awaits_prompt_scores and replaying.kept_tokens <= 36  # replayed, then evicted
    unbind(model)
    assert not model._forward_hooks


def _pass_through(forward, *args, **kwargs):
    return forward(*args, **kwargs)


def test_binding_keeps_a_library_forward_wrapper(fresh):
    """A forward that another library wrapped (as accelerate's device hooks do) stays inside decodekit's, comes
    back on unbind, and one wrapped after binding keeps decodekit's inside it, never wrapped twice."""
    model, tokenizer = fresh
    batch = _batch(tokenizer, PROMPTS[:1])
    expected = _greedy(model, tokenizer, batch, CompressedCache(model, budget=36))
    unbind(model)
    first, last = model.model.layers[0].self_attn, model.model.layers[-1].self_attn
    library = first.forward = partial(_pass_through, first.forward)
    CompressedCache(model, budget=36)
    unbind(model)
    assert first.__dict__["forward"] is library
    CompressedCache(model, budget=36)
    last.forward = partial(_pass_through, last.forward)  # wrapped after binding
    unbind(model)
    assert torch.equal(_greedy(model, tokenizer, batch, CompressedCache(model, budget=36)), expected)
    assert torch.equal(_greedy(model, tokenizer, batch, CompressedCache(model, budget=36)), expected)


def test_a_deep_copy_of_a_bound_model_observes_its_own_modules(fresh):
    model, tokenizer = fresh
    batch = _batch(tokenizer, PROMPTS[:1])
    CompressedCache(model, budget=36)
    twin = copy.deepcopy(model)
    expected = _greedy(model, tokenizer, batch, CompressedCache(model, budget=36))
    assert torch.equal(_greedy(twin, tokenizer, batch, CompressedCache(twin, budget=36)), expected)
    with pytest.raises(ValueError, match="built for another model"):
        twin(batch["input_ids"], past_key_values=CompressedCache(model, budget=36))


@pytest.mark.parametrize("decoder", ["built-in", "decodekit"])
def test_beam_search_reorders_the_scores_with_the_cache(fresh, decoder):
    model, tokenizer = fresh
    batch = _batch(tokenizer)
    kwargs = {"num_beams": 3, "max_new_tokens": 30}
    if decoder == "decodekit":
        kwargs["custom_generate"] = beam_search
    full = _greedy(model, tokenizer, batch, **kwargs)
    assert torch.equal(_greedy(model, tokenizer, batch, CompressedCache(model, budget=256), **kwargs), full)
    small = [_greedy(model, tokenizer, batch, CompressedCache(model, budget=24, recent_tokens=8), **kwargs)]
    small.append(
        _greedy(model, tokenizer, batch, CompressedCache(model, budget=24, recent_tokens=8), num_beams=3,
                max_new_tokens=30)
    )  # fmt: skip
    assert torch.equal(small[0], small[1]), "decodekit's and the built-in beam search agree on a compressed cache"


@pytest.mark.parametrize("decoder", ["built-in", "decodekit"])
def test_beam_search_over_reserved_room_matches_the_padded_path(fresh, decoder):
    """Beams reorder a prompt's rows every step; alone they reorder the reserved room, in a left-padded
    batch the dead-slot layout. The prompt's beams must come out the same."""
    model, tokenizer = fresh
    prompt = " ".join(PROMPTS * 2)
    kwargs = {"num_beams": 3, "max_new_tokens": 40}
    if decoder == "decodekit":
        kwargs["custom_generate"] = beam_search
    make = partial(CompressedCache, model, budget=40, recent_tokens=8)
    alone = _greedy(model, tokenizer, _batch(tokenizer, [prompt]), make(), **kwargs)
    batched = _greedy(model, tokenizer, _batch(tokenizer, [prompt, "x"]), make(), **kwargs)
    assert torch.equal(alone[0], batched[0, -alone.shape[1] :])


def test_two_threads_generating_on_one_model_each_get_their_own_result(fresh):
    """The queries travel from the pre-hook to the projection hook per thread, never across generations."""
    import threading

    model, tokenizer = fresh
    batches = [_batch(tokenizer, [PROMPTS[0] * 3]), _batch(tokenizer, [LONG])]
    expected = [
        _greedy(model, tokenizer, batch, CompressedCache(model, budget=40, recent_tokens=8)) for batch in batches
    ]
    results: dict[int, torch.Tensor] = {}

    def run(index: int) -> None:
        for _ in range(3):
            cache = CompressedCache(model, budget=40, recent_tokens=8)
            results[index] = _greedy(model, tokenizer, batches[index], cache)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(results[index], expected[index]) for index in range(2))


def test_reconstruction_scores_are_the_most_attention_a_replayed_prompt_pays(tiny, tiny_model_dir, monkeypatch):
    """Oracle: eager attention over the prompt followed by a copy of itself, max over the copy's queries;
    the final rank of an entry is the better of its two ranks (naive ranks computed here)."""
    import decodekit.cache.scorers.reconstruction as reconstruction

    seen = []
    original = reconstruction.union_of_ranks
    def capture(attention, replay, valid):
        seen.append((attention.clone(), replay.clone()))
        return original(attention, replay, valid)

    monkeypatch.setattr(reconstruction, "union_of_ranks", capture)
    _, tokenizer = tiny
    eager = LlamaForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    ids = _batch(tokenizer, [PROMPTS[1] + " " + PROMPTS[0]])["input_ids"]
    length = ids.shape[1]
    with torch.no_grad():
        attentions = eager(torch.cat([ids, ids], dim=1), output_attentions=True).attentions
        cache = CompressedCache(
            eager, compression_ratio=0.0, scoring="reconstruction", recent_tokens=1, sink_tokens=0, allocation="uniform"
        )
        eager(ids, past_key_values=cache)
    assert cache.get_seq_length() == length and cache.kept_tokens == length
    kv_heads = eager.config.num_key_value_heads
    for layer, weights, (paid, replay) in zip(cache.layers, attentions, seen, strict=True):
        copy_to_prompt = weights[0, :, length:, :length]  # [heads, copy queries, prompt keys]
        expected = copy_to_prompt.amax(dim=1).view(kv_heads, -1, length).amax(dim=1)
        torch.testing.assert_close(replay[0], expected, atol=1e-5, rtol=1e-4)
        assert layer.longest == length  # the copy was forgotten
        for head in range(kv_heads):
            second = {slot: rank for rank, slot in enumerate(replay[0, head].argsort().tolist())}
            first = {slot: rank for rank, slot in enumerate(paid[0, head].argsort().tolist())}
            better = torch.tensor([max(first[slot], second[slot]) for slot in range(length)], dtype=torch.float32)
            priority = layer.scorer.importance(layer, length)[0, head]  # proportional to the better rank
            torch.testing.assert_close(priority * better.sum(), better * priority.sum(), rtol=1e-4, atol=1e-6)


def test_reconstruction_scoring_evicts_to_the_target_and_refuses_padding(fresh):
    model, tokenizer = fresh
    ids = _batch(tokenizer, [LONG])["input_ids"]
    cache = CompressedCache(model, compression_ratio=0.5, scoring="reconstruction", reconstruction_chunk=16)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    heads = model.config.num_key_value_heads
    kept = sum(int(layer.storage.lengths_host.sum()) for layer in cache.layers)
    assert kept == len(cache.layers) * heads * math.ceil(0.5 * ids.shape[1])
    assert cache.get_seq_length() == ids.shape[1]
    output = _greedy(
        model, tokenizer, _batch(tokenizer, [LONG]), CompressedCache(model, budget=40, scoring="reconstruction")
    )
    assert output.shape[1] == ids.shape[1] + 24
    with pytest.raises(ValueError, match="needs prompts without left padding"):
        _greedy(model, tokenizer, _batch(tokenizer), CompressedCache(model, budget=40, scoring="reconstruction"))
    with pytest.raises(ValueError, match="scoring must be one of 'attention', 'reconstruction', 'attention\\+novelty'"):
        CompressedCache(model, budget=40, scoring="kvzip")


@pytest.mark.parametrize("interval", [1, 8])
def test_decoding_steps_add_their_decayed_attention_whether_scored_at_once_or_step_by_step(
    tiny, tiny_model_dir, interval
):
    """Oracle: eager attention rows of each new query. With an interval the steps' scoring waits for
    the next eviction (or a read of the scores) and is done at once; the scores must be the same."""
    _, tokenizer = tiny
    eager = LlamaForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    ids = _batch(tokenizer, [PROMPTS[1]])["input_ids"]
    length, steps, decay = ids.shape[1], 6, 0.5
    following = torch.tensor([[17, 5, 42, 9, 3, 11]])
    with torch.no_grad():
        cache = CompressedCache(eager, budget=200, score_decay=decay, eviction_interval=interval)
        eager(ids, past_key_values=cache)
        before = [layer.scores().clone() for layer in cache.layers]
        for step in range(steps):
            position = torch.tensor([[length + step]])
            eager(following[:, step : step + 1], past_key_values=cache, position_ids=position)
        waiting = [len(layer.scorer.waiting) for layer in cache.layers]
        attentions = eager(torch.cat([ids, following], dim=1), output_attentions=True).attentions
    # Every step waits with an interval, the first one too.
    assert waiting == [steps if interval > 1 else 0] * len(cache.layers)
    kv_heads, total = eager.config.num_key_value_heads, length + steps
    for layer, earlier, weights in zip(cache.layers, before, attentions, strict=True):
        expected = torch.cat([earlier[0, :, :length], torch.zeros(kv_heads, steps)], dim=-1) * decay**steps
        for step in range(steps):
            row = weights[0, :, length + step, :].view(kv_heads, -1, total).mean(dim=1)
            expected += decay ** (steps - 1 - step) * row
        # The tokens in slot order: nothing was evicted.
        torch.testing.assert_close(layer.scores()[0], expected, atol=1e-5, rtol=1e-4)
        assert (layer.storage.lengths_host == total).all()


def test_a_decoding_step_adds_the_new_query_attention_to_the_decayed_scores(tiny, tiny_model_dir):
    """Oracle: eager attention of the last query, averaged over the query heads of each KV head."""
    _, tokenizer = tiny
    eager = LlamaForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    ids = _batch(tokenizer, [PROMPTS[1]])["input_ids"]
    length = ids.shape[1]
    following = torch.tensor([[17]])
    with torch.no_grad():
        cache = CompressedCache(eager, compression_ratio=0.0, recent_tokens=1, sink_tokens=0, score_decay=0.5)
        eager(ids, past_key_values=cache)
        before = [layer.scores().clone() for layer in cache.layers]
        eager(following, past_key_values=cache, position_ids=torch.tensor([[length]]))
        attentions = eager(torch.cat([ids, following], dim=1), output_attentions=True).attentions
    kv_heads = eager.config.num_key_value_heads
    for layer, earlier, weights in zip(cache.layers, before, attentions, strict=True):
        last_query = weights[0, :, -1, :].view(kv_heads, -1, length + 1).mean(dim=1)
        expected = torch.cat([0.5 * earlier[0], torch.zeros(kv_heads, 1)], dim=-1) + last_query
        torch.testing.assert_close(layer.scores()[0], expected, atol=1e-5, rtol=1e-4)
