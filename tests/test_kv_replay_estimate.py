"""Reconstruction scores without a replay pass (``replay="prompt_queries"``): checked against a replay through the
model where the two must agree (a model's first layer, whose queries depend on their token alone), against a
naive loop with rotary embeddings at explicit positions in every layer, and for the cost it saves."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from decodekit.cache import CompressedCache
from decodekit.cache.replay_estimate import rotation_past
from decodekit.cache.scorers.reconstruction import ReconstructionScorer
from decodekit.cache.size import full_cache_bytes
from tests.families import FAMILIES, build_family_model

PROMPT = torch.randint(3, 384, (1, 40), generator=torch.Generator().manual_seed(5))


def _scores(model, replay: str, **options) -> list[torch.Tensor]:
    """Per layer ``[kv_heads, tokens]``: the reconstruction scores of ``PROMPT``, nothing evicted but what a sliding
    window has passed."""
    cache = CompressedCache(
        model, compression_ratio=0.0, scoring="reconstruction", allocation="layers", sink_tokens=0,
        reconstruction_chunk=options.pop("chunk", 16), replay=replay, **options,
    )  # fmt: skip
    with torch.no_grad():
        model(PROMPT, past_key_values=cache)
    length = PROMPT.shape[1]
    for layer in cache.layers:  # every head holds the prompt (a windowed layer its window's last tokens) in order
        first = 0 if layer.window is None else max(length - (layer.window - 1), 0)
        assert torch.equal(layer.positions()[0], torch.arange(first, length).int().expand(layer.storage.heads, -1))
    return [layer.scores()[0] for layer in cache.layers]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_in_a_first_layer_the_estimate_is_the_replay(family):
    """A first layer's queries and keys depend on their token alone, so a replayed token's query is the prompt's
    own: there the estimate must give what replaying the prompt through the model gives (sliding windows, query
    norms, partial rotary, biased projections included), and deeper layers differ. Chunks of 16 of the 40 tokens;
    on a model with sliding windows the estimate stands for a replay of the whole prompt in one chunk (a window
    places the chunk by the cache's count of tokens, after the prompt)."""
    model = build_family_model(family)
    windowed = CompressedCache(model, compression_ratio=0.5).options.sliding_windows
    replayed = _scores(model, "forward", chunk=64 if windowed else 16)
    estimated = _scores(model, "prompt_queries")
    torch.testing.assert_close(estimated[0], replayed[0], atol=1e-6, rtol=1e-4)
    assert (estimated[-1] - replayed[-1]).abs().max() > 1e-4  # the replay's own hidden states


def _naive_scores(model, ids: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """Per layer ``[kv_heads, tokens]``, one query at a time: the prompt pass's query of token ``p`` rotated at
    position ``length + p`` against every prompt key rotated at its position and against the keys of the tokens
    of ``p``'s chunk up to ``p`` rotated at ``length`` plus their position."""
    config, length = model.config, ids.shape[1]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    projected: dict[str, list[torch.Tensor]] = {"q": [], "k": []}
    hooks = [
        getattr(layer.self_attn, f"{part}_proj").register_forward_hook(
            lambda module, args, output, part=part: projected[part].append(output[0])
        )
        for layer in model.model.layers
        for part in ("q", "k")
    ]
    with torch.no_grad():
        model(ids)
        cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(2 * length)[None])
    for hook in hooks:
        hook.remove()

    def rotated(vector: torch.Tensor, position: int) -> torch.Tensor:
        half = vector.shape[-1] // 2
        turned_half = torch.cat([-vector[..., half:], vector[..., :half]], dim=-1)
        return vector * cos[0, position] + turned_half * sin[0, position]

    expected = []
    for queries, keys in zip(projected["q"], projected["k"], strict=True):
        queries, keys = queries.view(length, heads, head_dim), keys.view(length, kv_heads, head_dim)
        best = torch.zeros(kv_heads, length)
        for head in range(heads):
            kv_head = head // (heads // kv_heads)
            for p in range(length):
                query = rotated(queries[p, head], length + p)
                first_own = p // chunk * chunk
                seen = [rotated(keys[j, kv_head], j) for j in range(length)]
                seen += [rotated(keys[j, kv_head], length + j) for j in range(first_own, p + 1)]
                weights = (torch.stack(seen) @ query / head_dim**0.5).softmax(dim=0)[:length]
                best[kv_head] = torch.maximum(best[kv_head], weights)
        expected.append(best)
    return expected


@pytest.mark.parametrize(("chunk", "kv_bits"), [(16, None), (64, None), (16, 4)])
def test_the_estimate_matches_a_naive_loop_in_every_layer(chunk, kv_bits):
    """In every layer, the estimate is what the naive loop computes from the prompt pass's projections. With 4-bit
    storage the layer reads its keys rotated by a Hadamard matrix, which the estimate must undo around its move."""
    model = build_family_model("llama")
    estimated = _scores(model, "prompt_queries", chunk=chunk, kv_bits=kv_bits)
    for layer, expected in zip(estimated, _naive_scores(model, PROMPT, chunk), strict=True):
        torch.testing.assert_close(layer, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_turn_past_a_pass_is_the_rotary_turn_at_that_position_without_its_scaling(dtype):
    """Rotary types that scale cos and sin (YaRN) or stretch frequencies (Llama 3): the turn by ``length``
    positions made from a pass's embedding of positions 0 to ``length - 1`` (float32, or bfloat16 as a bf16 model
    hands it) is the float64 turn by the model's frequencies, to the rounding of that embedding at one position:
    a turn by position 1 taken ``length`` times would be off by whole radians in bfloat16."""
    for rope in (
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ):  # fmt: skip
        config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, rope_parameters=rope)
        rotary = LlamaForCausalLM(config).model.rotary_emb
        cos, sin = rotary(torch.zeros(1, dtype=dtype), torch.arange(32768)[None])
        assert cos.dtype == dtype and (rope["rope_type"] != "yarn" or cos[0, 0, 0] > 1.01)  # a scaling to remove
        for length in (2, 37, 2048, 32768):
            angles = (length * rotary.inv_freq.double()).repeat(2)[None]
            turn_cos, turn_sin = rotation_past(cos[:, :length], sin[:, :length])
            # float32 angles near 32768 radians are themselves rounded to about 4e-3
            tolerance = 2e-6 + 1.2e-7 * length if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(turn_cos.double(), angles.cos(), atol=tolerance, rtol=0)
            torch.testing.assert_close(turn_sin.double(), angles.sin(), atol=tolerance, rtol=0)
            torch.testing.assert_close(torch.hypot(turn_cos, turn_sin), torch.ones_like(turn_cos))


def test_the_estimate_feeds_no_second_pass_and_evicts_to_a_byte_size():
    """The model runs once for the prompt (a replay runs it once per chunk more), and the cache still keeps what
    the memory size allows, every head its own number."""
    model = build_family_model("llama")
    calls = []
    model.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    ids = torch.randint(3, 384, (1, 120), generator=torch.Generator().manual_seed(1))
    for replay, passes in (("forward", 1 + 3), ("prompt_queries", 1)):
        calls.clear()
        cache = CompressedCache(model, memory_fraction=0.25, scoring="reconstruction", reconstruction_chunk=48,
                                sink_tokens=2, recent_tokens=4, replay=replay)  # fmt: skip
        with torch.no_grad():
            model(ids, past_key_values=cache)
        assert len(calls) == passes
        assert cache.memory_bytes() <= 0.25 * full_cache_bytes(model, ids.shape[1], element_size=2)
        assert len(set(_head_counts(cache))) > 1


def _head_counts(cache) -> list[int]:
    """Per (layer, row, KV head): the tokens it keeps."""
    return [int(count) for layer in cache.layers for count in torch.as_tensor(layer.storage.lengths_host).flatten()]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"replay": "later"}, "replay must be one of 'auto', 'forward', 'prompt_queries'"),
        ({"allocation": "uniform"}, "needs allocation 'heads' or 'layers'"),
        ({"observation_window": 8}, "needs observation_window=None"),
        ({"replay_prefix": [5]}, "needs no replay_prefix"),
        ({"replay_overlap": 2}, "needs replay_overlap=0"),
        ({"replay_scope": "chunk"}, "needs replay_scope='prompt'"),
        ({"replay_output_norms": True}, "needs replay_output_norms=False"),
    ],
)
def test_bad_estimate_options_name_the_parameter(options, message):
    model = build_family_model("llama")
    options = {"replay": "prompt_queries", **options}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CompressedCache(model, compression_ratio=0.5, scoring="reconstruction", **options)
    if options["replay"] == "prompt_queries":
        with pytest.raises(ValueError, match="needs scoring='reconstruction'"):
            CompressedCache(model, compression_ratio=0.5, replay="prompt_queries")


def test_the_kv_replay_field_reaches_the_cache_and_the_command_line(tiny, tiny_model_dir, capsys):
    """``Strategy(kv_replay=...)`` builds the cache with that replay, ``--kv-replay`` prints what the library gives,
    and the field is refused where it cannot apply."""
    from decodekit.cli import main
    from decodekit.generation import generate_text
    from decodekit.strategies import Strategy

    model, tokenizer = tiny
    strategy = Strategy(kv_memory_fraction=0.25, kv_scoring="reconstruction", kv_replay="prompt_queries")
    assert strategy.plan(model).cache.options.replay.mode == "prompt_queries"
    assert Strategy(kv_memory_fraction=0.25, kv_scoring="reconstruction").plan(model).cache.options.replay.mode == (
        "auto"
    )
    prompt = "The class statement creates a new class object and binds it to a name. " * 4
    expected = generate_text(model, tokenizer, [prompt], strategy, max_new_tokens=8)[0]
    code = main(["generate", prompt, "--model", str(tiny_model_dir), "--max-new-tokens", "8", "--kv-memory", "0.25",
                 "--kv-scoring", "reconstruction", "--kv-replay", "prompt_queries"])  # fmt: skip
    assert code == 0 and capsys.readouterr().out.rstrip("\n") == expected.rstrip("\n")
    with pytest.raises(ValueError, match="kv_replay applies to kv_scoring=reconstruction"):
        Strategy(kv_budget=40, kv_scoring="attention", kv_replay="prompt_queries")
    with pytest.raises(ValueError, match="kv_replay must be one of auto, forward, prompt_queries"):
        Strategy(kv_budget=40, kv_scoring="reconstruction", kv_replay="later")
    for scoring in ([], ["--kv-scoring", "attention"]):
        code = main(["generate", "Hi", "--model", str(tiny_model_dir), "--kv-budget", "40", *scoring,
                     "--kv-replay", "forward"])  # fmt: skip
        error = capsys.readouterr().err
        assert code == 2 and "error: --kv-replay applies to --kv-scoring" in error and "Traceback" not in error


@pytest.mark.parametrize(
    "size",
    [{"budget": 36}, {"budget": 37}, {"compression_ratio": 0.6, "eviction_interval": 1},
     {"memory_fraction": 0.25}, {"memory_fraction": 0.1, "kv_bits": 8}],
)  # fmt: skip
def test_rows_of_a_batch_keep_and_decode_what_each_keeps_alone(tiny, size):
    """Each row's estimate sees its own prompt only, down to the budget's floor (sinks and recent tokens) and under
    byte sizes; a batch decodes what each prompt decodes alone, and keeps the same tokens per head."""
    from tests.test_kv_allocation import TEXT, _ids
    from tests.tiny import build_model

    _, tokenizer = tiny
    model = build_model(tokenizer, num_layers=4)
    first, second = _ids(tokenizer), _ids(tokenizer, (TEXT[60:] + TEXT[:60]) * 3)

    def make():
        return CompressedCache(model, scoring="reconstruction", replay="prompt_queries", reconstruction_chunk=16,
                               **size)  # fmt: skip

    caches = [make() for _ in range(3)]
    alone = [model.generate(ids, past_key_values=cache, do_sample=False, max_new_tokens=10)
             for ids, cache in zip((first, second), caches, strict=False)]  # fmt: skip
    together = model.generate(torch.cat([first, second]), past_key_values=caches[2], do_sample=False,
                              max_new_tokens=10)  # fmt: skip
    assert torch.equal(together, torch.cat(alone))
    for row in range(2):
        for layer, own in zip(caches[2].layers, caches[row].layers, strict=True):
            for head in range(layer.storage.heads):
                kept, expected = layer.kept_positions()[row, head], own.kept_positions()[0, head]  # -1: keeping fewer
                assert torch.equal(kept[kept >= 0], expected[expected >= 0])
    assert min(_head_counts(caches[2])) >= 36  # no head below the sinks and the recent window


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_estimates_follow_the_float32_one(tiny, dtype):
    """In 16-bit models the estimate runs in float32 over the keys as attention reads them: its scores follow the
    float32 model's within the rounding of 16-bit keys and queries, and no score is NaN."""
    from tests.tiny import build_model

    _, tokenizer = tiny
    model = build_model(tokenizer, num_layers=2)
    ids = torch.randint(3, 384, (1, 64), generator=torch.Generator().manual_seed(3))

    def scores(model):
        cache = CompressedCache(model, compression_ratio=0.0, scoring="reconstruction", allocation="layers",
                                reconstruction_chunk=32, replay="prompt_queries")  # fmt: skip
        with torch.no_grad():
            model(ids, past_key_values=cache)
        return torch.stack([layer.scores().float() for layer in cache.layers])

    exact = scores(model)
    half = scores(build_model(tokenizer, num_layers=2).to(dtype))
    assert torch.isfinite(half).all()
    torch.testing.assert_close(half, exact, atol=0.03, rtol=0.05)


def test_a_one_token_prompt_and_a_later_pass_are_not_replayed():
    """A one-token prompt has nothing to rank (its scores stay 0); passes after the first are scored as usual."""
    model = build_family_model("llama")
    cache = CompressedCache(model, budget=36, scoring="reconstruction", replay="prompt_queries")
    output = model.generate(PROMPT[:, :1], past_key_values=cache, do_sample=False, max_new_tokens=50, pad_token_id=2)
    assert output.shape[1] == 51 and max(_head_counts(cache)) <= 37


def test_a_prompt_given_as_embeddings_needs_no_token_ids_to_be_estimated():
    """Only a replay pass feeds token ids again: the estimate takes a prompt given as ``inputs_embeds``, and scores
    it as it scores the same prompt given as ids; the replay pass asks for the ids."""
    model = build_family_model("llama")
    embeddings = model.get_input_embeddings()(PROMPT)

    def kept(replay: str, **prompt) -> list[torch.Tensor]:
        cache = CompressedCache(model, compression_ratio=0.5, scoring="reconstruction", sink_tokens=2,
                                recent_tokens=4, replay=replay)  # fmt: skip
        with torch.no_grad():
            model(**prompt, past_key_values=cache)
        return [layer.kept_positions() for layer in cache.layers]

    by_embeddings, by_ids = kept("prompt_queries", inputs_embeds=embeddings), kept("prompt_queries", input_ids=PROMPT)
    assert all(torch.equal(a, b) for a, b in zip(by_embeddings, by_ids, strict=True))
    heads = sum(part.shape[0] * part.shape[1] for part in by_ids)  # (layer, row, KV head)s
    assert sum(int((part >= 0).sum()) for part in by_ids) == heads * PROMPT.shape[1] // 2
    with pytest.raises(ValueError, match="needs each forward pass of several tokens to receive its input_ids"):
        kept("forward", inputs_embeds=embeddings)


@pytest.mark.parametrize(
    ("size", "estimated"),
    [({"compression_ratio": 0.5}, True), ({"compression_ratio": 0.51}, False), ({"budget": 60}, True),
     ({"budget": 59}, False), ({"memory_fraction": 0.42}, True), ({"memory_fraction": 0.05}, False),
     ({"compression_ratio": 0.5, "allocation": "uniform"}, False),
     ({"compression_ratio": 0.5, "observation_window": 8}, False)],
)  # fmt: skip
def test_auto_estimates_where_a_head_keeps_half_the_prompt_and_replays_elsewhere(size, estimated):
    """The default ``replay="auto"`` keeps what ``"prompt_queries"`` keeps where a head keeps on average at least half
    of the 120-token prompt (60 tokens: the edge, and one token below it), and what the replay pass keeps at smaller
    sizes or where the estimate does not apply (a uniform allocation, an observation window), with no error; the
    model runs once, or once per replayed chunk more."""
    model = build_family_model("llama")
    calls = []
    model.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    ids = torch.randint(3, 384, (1, 120), generator=torch.Generator().manual_seed(1))
    kept = {}
    for replay in ("auto", "prompt_queries" if estimated else "forward"):
        options = {"reconstruction_chunk": 48, "sink_tokens": 2, "recent_tokens": 4, **size}
        if replay == "prompt_queries" and "allocation" in options:
            continue  # the estimate refuses them (tested above)
        calls.clear()
        cache = CompressedCache(model, scoring="reconstruction", replay=replay, **options)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        assert len(calls) == (1 if estimated else 1 + 3)
        kept[replay] = [layer.kept_positions() for layer in cache.layers]
    if len(kept) == 2:
        (auto, named) = kept.values()
        assert all(torch.equal(a, b) for a, b in zip(auto, named, strict=True))


@pytest.mark.parametrize("family", ["mistral-sliding", "gemma3"])
def test_auto_estimates_at_every_size_on_a_model_with_sliding_windows(family):
    """On a model with sliding-window layers ``replay="auto"`` keeps what ``"prompt_queries"`` keeps even where a head
    keeps a quarter of the prompt, and the model runs once: a replay pass would feed its second chunk with no window
    of context."""
    model = build_family_model(family)
    calls = []
    model.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    ids = torch.randint(3, 384, (1, 120), generator=torch.Generator().manual_seed(1))
    kept = {}
    for replay in ("auto", "prompt_queries"):
        calls.clear()
        cache = CompressedCache(model, compression_ratio=0.75, scoring="reconstruction", replay=replay,
                                reconstruction_chunk=48, sink_tokens=2, recent_tokens=4)  # fmt: skip
        assert cache.options.sliding_windows
        with torch.no_grad():
            model(ids, past_key_values=cache)
        assert len(calls) == 1
        kept[replay] = [layer.kept_positions() for layer in cache.layers]
    assert all(torch.equal(a, b) for a, b in zip(kept["auto"], kept["prompt_queries"], strict=True))
    plain = CompressedCache(build_family_model("llama"), compression_ratio=0.75, scoring="reconstruction")
    assert not plain.options.sliding_windows


@torch.no_grad()
def test_auto_takes_a_prompt_given_as_embeddings_only_where_it_estimates():
    """Under ``replay="auto"`` a size that keeps half the prompt is estimated, so a prompt given as embeddings is
    taken; a smaller size replays the prompt, which needs its token ids, and says so."""
    model = build_family_model("llama")
    embeddings = model.get_input_embeddings()(PROMPT)
    for ratio in (0.5, 0.75):
        cache = CompressedCache(model, compression_ratio=ratio, scoring="reconstruction", sink_tokens=2,
                                recent_tokens=4)  # fmt: skip
        if ratio == 0.5:
            model(inputs_embeds=embeddings, past_key_values=cache)
            counts = _head_counts(cache)
            assert sum(counts) == len(counts) * PROMPT.shape[1] // 2
        else:
            with pytest.raises(ValueError, match="needs each forward pass of several tokens to receive"):
                model(inputs_embeds=embeddings, past_key_values=cache)


def _attention_paid(model, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """``[kv_heads, tokens]``: the attention each prompt entry of ``layer`` received in a plain forward, from eager
    attention's weights: the mean over the queries that see it and the query heads of its KV head."""
    model.set_attn_implementation("eager")
    try:
        weights = model(ids, output_attentions=True).attentions[layer][0]  # [heads, queries, keys]
    finally:
        model.set_attn_implementation("sdpa")
    heads, length, _ = weights.shape
    kv_heads = model.config.num_key_value_heads
    group = heads // kv_heads
    seen_by = torch.arange(length, 0, -1)  # (causal: entry j is seen by the length - j queries from j on)
    return weights.view(kv_heads, group, length, length).sum(dim=(1, 2)) / (group * seen_by)


@pytest.mark.parametrize("seed", [0, 1, 2])
@torch.no_grad()
def test_a_global_layer_of_a_windowed_model_keeps_the_prompts_most_attended_entries(monkeypatch, seed):
    """On a model with sliding-window layers, where reconstruction shares the size by replay scores
    (``allocation="heads"``), each global layer then keeps its share by the better of an entry's replay rank and
    its prompt-attention rank: so each KV head keeps the quarter of its share that the prompt's queries attended most
    (the oracle: eager attention's weights). Ranked by replay scores alone (as a model without windows ranks) it
    does not."""
    model = build_family_model("gemma3", seed=seed)  # layer 1 is global, layer 0 slides a window of 10
    ids = torch.randint(3, 384, (1, 120), generator=torch.Generator().manual_seed(seed))
    paid = _attention_paid(model, ids, layer=1)

    def top_quarter_kept() -> list[bool]:
        cache = CompressedCache(model, compression_ratio=0.75, scoring="reconstruction", allocation="heads",
                                sink_tokens=2, recent_tokens=4)  # fmt: skip
        model(ids, past_key_values=cache)
        kept = cache.layers[1].kept_positions()[0]
        answers = []
        for head, positions in enumerate(kept):
            held = set(positions[positions >= 0].tolist())
            ranked = (paid[head, 2:116].argsort(descending=True) + 2).tolist()  # (sinks and recent tokens aside)
            answers.append(set(ranked[: (len(held) - 6) // 4]) <= held)
        return answers

    assert all(top_quarter_kept())
    monkeypatch.setattr(ReconstructionScorer, "joins_attention", lambda self, layer: False)
    assert not any(top_quarter_kept())


@pytest.mark.parametrize("seed", [0, 1, 2])
@torch.no_grad()
def test_by_default_a_global_layer_of_a_windowed_model_keeps_what_the_prompt_attended_most(seed):
    """By default on a model with sliding-window layers, with most of the tokens evicted, every layer keeps its even
    share, and a global layer ranks its prompt by the attention the prompt's queries paid each entry times its
    value's norm, as attention scoring ranks: each KV head keeps its sinks, its recent tokens and exactly the entries
    that rank highest by that (the oracle: eager attention's weights and the values of a plain forward)."""
    model = build_family_model("gemma3", seed=seed)  # layer 1 is global, layer 0 slides a window of 10
    ids = torch.randint(3, 384, (1, 120), generator=torch.Generator().manual_seed(seed))
    paid = _attention_paid(model, ids, layer=1)
    full = DynamicCache(config=model.config)
    model(ids, past_key_values=full)
    value_norms = full.layers[1].values[0].float().norm(dim=-1)  # [kv_heads, tokens]
    cache = CompressedCache(model, compression_ratio=0.9, scoring="reconstruction", sink_tokens=2, recent_tokens=4)
    model(ids, past_key_values=cache)
    assert cache.options.size.allocation == "uniform"
    kept = cache.layers[1].kept_positions()[0]
    for head, positions in enumerate(kept):
        held = set(positions[positions >= 0].tolist())
        assert len(held) == 12  # (a tenth of 120)
        ranked = ((paid[head] * value_norms[head])[2:116].argsort(descending=True) + 2).tolist()
        assert held == {0, 1, 116, 117, 118, 119} | set(ranked[: len(held) - 6])


@pytest.mark.parametrize(("family", "size", "allocation"), [
    ("gemma3", {"compression_ratio": 0.9}, "uniform"), ("gemma3", {"compression_ratio": 0.85}, "uniform"),
    ("gemma3", {"compression_ratio": 0.8}, "heads"), ("gemma3", {"memory_fraction": 0.05}, "heads"),
    ("gemma3", {"budget": 40}, "heads"), ("mistral-sliding", {"compression_ratio": 0.9}, "uniform"),
    ("llama", {"compression_ratio": 0.9}, "heads"),
])  # fmt: skip
def test_reconstructions_default_allocation_on_models_with_and_without_windows(family, size, allocation):
    """Reconstruction shares the size among KV heads by default, but keeps every layer's even share on a model with
    sliding-window layers told to evict 85% of the tokens or more; an allocation given is kept."""
    model = build_family_model(family)
    assert CompressedCache(model, scoring="reconstruction", **size).options.size.allocation == allocation
    given = CompressedCache(model, scoring="reconstruction", allocation="layers", **size)
    assert given.options.size.allocation == "layers"


@pytest.mark.parametrize(("tokens", "chunk"), [(1, None), (2, None), (60, 16)])
@torch.no_grad()
def test_even_shares_on_a_windowed_model_take_a_one_token_prompt_and_a_prompt_in_chunks(tokens, chunk):
    """Even shares with the replay estimated (a windowed model, 90% evicted) at their edges: a one-token prompt
    (nothing to estimate), two tokens, and a prompt read in chunks (the first estimated, the later ones replayed):
    generate runs, every row and head stays within its target, and no estimate is left held after the prompt."""
    model = build_family_model("gemma3")
    ids = torch.randint(3, 384, (1, tokens), generator=torch.Generator().manual_seed(0))
    cache = CompressedCache(model, compression_ratio=0.9, scoring="reconstruction", sink_tokens=2, recent_tokens=4)
    chunked = {"prefill_chunk_size": chunk} if chunk else {}
    output = model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False, pad_token_id=2, **chunked)
    assert output.shape[1] == tokens + 5
    assert cache.options.size.allocation == "uniform"
    for layer in cache.layers:
        assert (layer.storage.lengths_host <= layer.targets()).all()
        assert layer.scorer.estimated is None and layer.scorer.prompt_attention is None
