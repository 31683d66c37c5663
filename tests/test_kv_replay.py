"""How a reconstruction-scoring cache replays its prompt: a prefix, an overlap between chunks, and the scope
a chunk's attention is spread over, each checked against eager attention over the prompt followed by the
replayed pieces."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from decodekit.cache import CompressedCache

TEXT = "The class statement creates a new class object and binds it to a name in the local namespace. " * 2


def _expected_replay_scores(model, ids, chunk, prefix, overlap, scope, sinks):
    """Per layer ``[kv_heads, length]``: the most attention any replay query pays each prompt token, from
    eager attention over [prompt, piece] with the pieces built here (restricted to the chunk by renormalizing
    the softmax over what the chunk scores)."""
    length = ids.shape[1]
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    best = [torch.zeros(kv_heads, length) for _ in range(model.config.num_hidden_layers)]
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        piece = torch.cat([torch.tensor([prefix], dtype=ids.dtype), ids[:, max(start - overlap, 0) : stop]], dim=1)
        positions = torch.cat([torch.arange(length), torch.arange(length + start, length + start + piece.shape[1])])
        with torch.no_grad():
            attentions = model(
                torch.cat([ids, piece], dim=1), position_ids=positions[None], output_attentions=True
            ).attentions
        for layer, weights in enumerate(attentions):
            replayed = weights[0, :, length:, :]  # [heads, piece queries, every key]
            if scope == "chunk":
                scored = torch.ones(replayed.shape[-1], dtype=torch.bool)
                scored[sinks:start] = False
                scored[stop:length] = False
                replayed = replayed * scored
                replayed = replayed / replayed.sum(dim=-1, keepdim=True)
                replayed = replayed.masked_fill(~scored, 0)
            chunk_best = replayed[..., :length].amax(dim=1).view(kv_heads, heads // kv_heads, length).amax(dim=1)
            best[layer] = torch.maximum(best[layer], chunk_best)
    return best


@pytest.mark.parametrize(
    ("chunk", "prefix", "overlap", "scope"),
    [(64, (), 0, "prompt"), (16, (5, 9, 11), 0, "prompt"), (16, (), 4, "prompt"), (16, (7, 3), 4, "chunk")],
)
def test_replay_scores_follow_prefix_overlap_and_scope(tiny, tiny_model_dir, chunk, prefix, overlap, scope):
    _, tokenizer = tiny
    eager = LlamaForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"][:, :40]
    sinks = 2
    cache = CompressedCache(
        eager, compression_ratio=0.0, scoring="reconstruction", allocation="layers", sink_tokens=sinks,
        recent_tokens=1, reconstruction_chunk=chunk, replay_prefix=list(prefix), replay_overlap=overlap,
        replay_scope=scope, replay="forward",
    )  # fmt: skip
    with torch.no_grad():
        eager(ids, past_key_values=cache)
    expected = _expected_replay_scores(eager, ids, chunk, prefix, overlap, scope, sinks)
    for layer, scores in zip(cache.layers, expected, strict=True):
        # The replayed pieces were forgotten: each head holds the prompt's tokens alone.
        assert torch.as_tensor(layer.storage.lengths_host).tolist() == [[ids.shape[1]] * layer.storage.heads]
        assert torch.equal(layer.kept_positions()[0], torch.arange(ids.shape[1]).int().expand(layer.storage.heads, -1))
        torch.testing.assert_close(layer.scores()[0], scores, atol=1e-5, rtol=1e-4)


def test_replay_options_change_the_scores_and_the_default_is_the_plain_replay(tiny, tiny_model_dir):
    """Mutation guard for the oracle above: each option alone moves the scores away from the plain replay."""
    _, tokenizer = tiny
    eager = LlamaForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"][:, :40]

    def scores(**options):
        cache = CompressedCache(
            eager, compression_ratio=0.0, scoring="reconstruction", allocation="layers", reconstruction_chunk=16,
            **options,
        )  # fmt: skip
        with torch.no_grad():
            eager(ids, past_key_values=cache)
        return torch.stack([layer.scores() for layer in cache.layers])

    plain = scores()
    torch.testing.assert_close(plain, scores(replay_prefix=(), replay_overlap=0, replay_scope="prompt"))
    for options in ({"replay_prefix": [5, 9]}, {"replay_overlap": 4}, {"replay_scope": "chunk"}):
        assert not torch.allclose(plain, scores(**options), atol=1e-4), options


def test_replay_options_evict_to_the_target_under_heads(fresh_tiny):
    model, tokenizer = fresh_tiny
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"][:, :40]
    cache = CompressedCache(
        model, compression_ratio=0.5, scoring="reconstruction", recent_tokens=4, reconstruction_chunk=16,
        replay_prefix=[1, 2, 3], replay_overlap=8, replay_scope="chunk",
    )  # fmt: skip
    with torch.no_grad():
        model(ids, past_key_values=cache)
    assert cache.options.size.allocation == "heads"
    counts = [int(count) for layer in cache.layers for count in torch.as_tensor(layer.storage.lengths_host).flatten()]
    assert sum(counts) == len(counts) * 20
    assert cache.get_seq_length() == ids.shape[1]
    for layer in cache.layers:
        assert layer.scorer.replay_span is None and not layer.scorer.replaying and not layer.transient
        assert bool((layer.positions() < ids.shape[1]).all())  # the replayed pieces were forgotten


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"replay_scope": "window"}, "replay_scope must be one of 'prompt', 'chunk'; got 'window'"),
        ({"replay_overlap": -1}, "replay_overlap must be an integer >= 0; got -1"),
        ({"replay_overlap": 16}, "replay_overlap must be smaller than reconstruction_chunk \\(16\\); got 16"),
        ({"replay_overlap": 2.5}, "replay_overlap must be an integer >= 0; got 2.5"),
        ({"replay_prefix": "Repeat"}, "replay_prefix must be a sequence of token ids"),
        ({"replay_prefix": [3, -1]}, "replay_prefix must be an integer >= 0 \\(a token id\\); got -1"),
        ({"replay_prefix": 7}, "replay_prefix must be a sequence of token ids"),
    ],
)
def test_bad_replay_options_name_the_parameter(fresh_tiny, options, message):
    model, _ = fresh_tiny
    with pytest.raises(ValueError, match=message):
        CompressedCache(model, compression_ratio=0.5, scoring="reconstruction", reconstruction_chunk=16, **options)


def test_a_tensor_prefix_is_taken_as_token_ids(fresh_tiny):
    model, _ = fresh_tiny
    prefix = torch.tensor([[4, 5]])
    cache = CompressedCache(model, compression_ratio=0.5, scoring="reconstruction", replay_prefix=prefix)
    assert cache.options.replay.prefix == (4, 5)


def test_output_norm_weighting_follows_kvzip_plus(tiny, tiny_model_dir):
    """Oracle: each replay query's attention weights from eager attention, divided by the norm of the query
    token's hidden state entering attention and multiplied by the norm of ``W_O`` (the query head's block of the
    output projection) times the entry's value, maximized over queries and the group's heads."""
    _, tokenizer = tiny
    eager = LlamaForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"][:, :30]
    length = ids.shape[1]
    config = eager.config
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    captured = {}

    def keep_input(module, args, kwargs):
        captured[module.layer_idx] = kwargs["hidden_states"]

    handles = [layer.self_attn.register_forward_pre_hook(keep_input, with_kwargs=True) for layer in eager.model.layers]
    positions = torch.cat([torch.arange(length), torch.arange(length, 2 * length)])
    with torch.no_grad():
        output = eager(
            torch.cat([ids, ids], dim=1), position_ids=positions[None], output_attentions=True, use_cache=True
        )
    for handle in handles:
        handle.remove()
    cache = CompressedCache(
        eager, compression_ratio=0.0, scoring="reconstruction", allocation="layers", replay_output_norms=True
    )
    with torch.no_grad():
        eager(ids, past_key_values=cache)
    for index, (layer, weights) in enumerate(zip(cache.layers, output.attentions, strict=True)):
        hidden_norms = captured[index][0, length:].norm(dim=-1)  # [replay queries]
        values = output.past_key_values.layers[index].values[0, :, :length]  # [kv_heads, prompt, head_dim]
        blocks = eager.model.layers[index].self_attn.o_proj.weight.view(-1, heads, head_dim)
        per_head_values = values.repeat_interleave(heads // kv_heads, dim=0)  # [heads, prompt, head_dim]
        output_norms = torch.einsum("xhd,htd->htx", blocks, per_head_values).norm(dim=-1)  # [heads, prompt]
        weighted = weights[0, :, length:, :length] / hidden_norms[None, :, None] * output_norms[:, None, :]
        expected = weighted.amax(dim=1).view(kv_heads, -1, length).amax(dim=1)
        torch.testing.assert_close(layer.scores()[0], expected, atol=1e-5, rtol=1e-4)
    plain = CompressedCache(eager, compression_ratio=0.0, scoring="reconstruction", allocation="layers")
    with torch.no_grad():
        eager(ids, past_key_values=plain)
    assert not torch.allclose(plain.layers[0].scores(), cache.layers[0].scores(), atol=1e-4)
    assert all(layer.scorer.replay_weights is None for layer in cache.layers)


def test_each_head_stored_apart_scores_as_its_layer_does_under_every_replay_option(tiny, tiny_model_dir):
    """``allocation="heads"`` (each KV head a segment of its own length) weighs each KV head by its own query heads:
    its replay scores equal the ones a layer whose heads keep one number (``allocation="layers"``) gives that
    head."""
    _, tokenizer = tiny
    eager = LlamaForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"][:, :40]
    options = {
        "compression_ratio": 0.0, "scoring": "reconstruction", "reconstruction_chunk": 16, "replay_prefix": [5, 6],
        "replay_overlap": 4, "replay_scope": "chunk", "replay_output_norms": True,
    }  # fmt: skip
    whole = CompressedCache(eager, allocation="layers", **options)
    apart = CompressedCache(eager, allocation="heads", **options)
    with torch.no_grad():
        eager(ids, past_key_values=whole)
        eager(ids, past_key_values=apart)
    kv_heads = eager.config.num_key_value_heads
    for layer, heads in zip(whole.layers, apart.layers, strict=True):
        assert heads.storage.heads == kv_heads
        assert torch.equal(heads.positions(), layer.positions())
        whole_scores, apart_scores = layer.scores(), heads.scores()
        for head in range(kv_heads):
            torch.testing.assert_close(apart_scores[0, head], whole_scores[0, head], atol=1e-6, rtol=1e-5)


def test_a_replayed_piece_of_one_token_is_scored_as_the_pytorch_path_scores_it(fresh_tiny):
    """A 33-token prompt replayed in chunks of 16 ends with a piece of one token: on a coded byte-sized cache its pass
    is scored from the entries as attention reads them (no step read by the CPU operator, whose result would carry
    no keys to score by). Oracle: the same cache decoding in PyTorch (``scoring_backend="torch"``): the same kept
    positions and scores, and the next token's logits."""
    model, tokenizer = fresh_tiny
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"][:, :33]
    runs = []
    for backend in ("auto", "torch"):
        cache = CompressedCache(model, memory_fraction=0.25, scoring="reconstruction", reconstruction_chunk=16,
                                replay="forward", scoring_backend=backend)  # fmt: skip
        with torch.no_grad():
            model(ids, past_key_values=cache)
            logits = model(ids[:, -1:], past_key_values=cache, position_ids=torch.tensor([[33]])).logits
        runs.append((logits, [(layer.kept_positions(), layer.scores()) for layer in cache.layers]))
    (ours, kept), (theirs, expected) = runs
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=2e-4)
    for (positions, scores), (want_positions, want_scores) in zip(kept, expected, strict=True):
        assert torch.equal(positions, want_positions)
        torch.testing.assert_close(scores, want_scores, atol=1e-6, rtol=1e-5)
