"""CompressedCache on every supported model family, against DynamicCache, masked full passes and eager weights."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from decodekit.cache import CompressedCache
from tests.families import FAMILIES, build_family_model

SINKS, RECENT = 3, 9  # the families' sliding windows (10) cover exactly the recent tokens of the next query


def _padded_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 384, (2, 40), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :15] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 2), "attention_mask": mask}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_budget_above_the_length_gives_the_tokens_of_dynamic_cache(family, attention):
    model = build_family_model(family)
    model.set_attn_implementation(attention)
    batch = _padded_batch()
    common = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": 2}
    full = model.generate(**batch, past_key_values=DynamicCache(), **common)
    cache = CompressedCache(model, budget=256)
    assert torch.equal(model.generate(**batch, past_key_values=cache, **common), full)


def _oracle_masks(model, total: int, evicted: range, window: int | None, new_tokens: int) -> dict[str, torch.Tensor]:
    """Per layer type, the 4D mask of a full pass in which the last ``new_tokens`` queries miss ``evicted``."""
    causal = torch.tril(torch.ones(total, total, dtype=torch.bool))
    full = causal.clone()
    full[total - new_tokens :, evicted.start : evicted.stop] = False
    masks = {"full_attention": full[None, None]}
    if window is not None:
        offsets = torch.arange(total)[:, None] - torch.arange(total)[None, :]
        masks["sliding_attention"] = (causal & (offsets < window))[None, None]
    return masks


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("new_tokens", [1, 2])
def test_after_eviction_new_tokens_see_what_a_masked_full_forward_shows_them(family, new_tokens):
    model = build_family_model(family)
    ids = torch.randint(3, 384, (1, 60), generator=torch.Generator().manual_seed(1))
    following = torch.tensor([[17, 5]])[:, :new_tokens]
    cache = CompressedCache(model, budget=SINKS + RECENT, sink_tokens=SINKS, recent_tokens=RECENT)
    window = getattr(model.config, "sliding_window", None)
    layer_types = getattr(model.config, "layer_types", None)
    total = 60 + new_tokens
    masks = _oracle_masks(model, total, range(SINKS, 60 - RECENT), window, new_tokens)
    if layer_types is not None and len(set(layer_types)) > 1:
        mask = masks  # one mask per layer type
    elif window is not None:
        mask = masks["sliding_attention"]  # every layer slides
    else:
        mask = masks["full_attention"]
    with torch.no_grad():
        model(ids, past_key_values=cache)
        positions = torch.arange(60, total)[None]
        cached = model(following, past_key_values=cache, position_ids=positions).logits
        reference = model(torch.cat([ids, following], dim=1), attention_mask=mask).logits[:, 60:]
    torch.testing.assert_close(cached, reference, atol=1e-5, rtol=1e-4)
    assert cache.get_seq_length() == total


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_scores_equal_the_eager_attention_each_token_receives(family):
    """Oracle: eager attention weights, summed over the queries that see each key and averaged per KV head."""
    model = build_family_model(family)
    model.set_attn_implementation("eager")
    ids = torch.randint(3, 384, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
        cache = CompressedCache(model, compression_ratio=0.0, recent_tokens=1, sink_tokens=0)
        model(ids, past_key_values=cache)
    kv_heads = model.config.num_key_value_heads
    keys = torch.arange(30)
    for layer, weights in zip(cache.layers, attentions, strict=True):
        window = layer.window
        seen_by = (30 - keys if window is None else torch.clamp(30 - keys, max=window)).float()
        expected = (weights[0].sum(dim=1) / seen_by).view(kv_heads, -1, 30).mean(dim=1)
        # Each slot holds its own token: every one, or under a sliding window the window's last tokens, as the full
        # cache holds them (the others can never be seen again).
        held = keys if layer.cap is None else keys[-layer.cap :]
        assert torch.equal(layer.positions()[0], held.expand(kv_heads, -1).int())
        torch.testing.assert_close(layer.scores()[0], expected[:, held], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_heads_stored_apart_score_each_token_as_the_whole_layer_does(family):
    """allocation="heads" gives each KV head a segment of its own (fused projections and query norms included):
    every head's replay scores equal that head's scores in a layer whose heads keep one number
    (allocation="layers")."""
    model = build_family_model(family)
    ids = torch.randint(3, 384, (1, 40), generator=torch.Generator().manual_seed(2))
    caches = {
        allocation: CompressedCache(model, compression_ratio=0.0, scoring="reconstruction", allocation=allocation)
        for allocation in ("layers", "heads")
    }
    with torch.no_grad():
        for cache in caches.values():
            model(ids, past_key_values=cache)
    for whole, apart in zip(caches["layers"].layers, caches["heads"].layers, strict=True):
        whole_scores, apart_scores = whole.scores(), apart.scores()
        assert apart.storage.heads == whole_scores.shape[1] > 1
        held = 40 if apart.cap is None else apart.cap  # a windowed layer holds its window's tokens, as DynamicCache
        assert torch.as_tensor(apart.storage.lengths_host).tolist() == [[held] * apart.storage.heads]
        assert torch.equal(apart.positions(), whole.positions())
        for head in range(apart.storage.heads):
            torch.testing.assert_close(apart_scores[:, head], whole_scores[:, head], atol=1e-6, rtol=1e-5)
    cache = CompressedCache(model, compression_ratio=0.5, scoring="reconstruction", allocation="heads",
                            sink_tokens=2, recent_tokens=4, eviction_interval=1)  # fmt: skip
    output = model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False, pad_token_id=2)
    assert output.shape[1] == 46  # 45 tokens seen: the heads keep half of them in all, each its own number
    kept = [int(count) for layer in cache.layers for count in layer.storage.lengths_host[0]]  # per (layer, KV head)
    assert sum(kept) <= len(kept) * 23 and len(set(kept)) > 1
