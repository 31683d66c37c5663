"""The prompt read in chunks (``prefill_chunk``, generate's ``prefill_chunk_size``): a compressed cache never holds
more than its size and one chunk, and generate's text equals a loop of forward passes written here."""

from __future__ import annotations

import pytest
import torch

from decodekit import Strategy
from decodekit.cache import CompressedCache, full_cache_bytes
from decodekit.cli import main
from tests.tiny import build_model

PROMPT_TOKENS, BUDGET, CHUNK, NEW_TOKENS = 100, 40, 16, 12


@pytest.fixture
def fresh(tiny):
    _, tokenizer = tiny
    return build_model(tokenizer), tokenizer


def _prompt(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))


def _passes(model, cache, run) -> list[tuple[int, int, int]]:
    """Per forward pass of ``run``: tokens the cache kept before it, tokens it read, tokens kept after it."""
    passes, before = [], []

    def enter(_module, _args, kwargs):
        before.append(cache.kept_tokens)

    def leave(_module, _args, kwargs, _output):
        passes.append((before.pop(), kwargs["input_ids"].shape[1], cache.kept_tokens))

    hooks = [model.register_forward_pre_hook(enter, with_kwargs=True),
             model.register_forward_hook(leave, with_kwargs=True)]  # fmt: skip
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return passes


def test_a_chunked_prompt_never_holds_more_than_the_budget_and_one_chunk(fresh):
    """A pass's attention holds what the cache kept before it and the tokens it reads; after it, the cache is back
    within its budget (and the eviction interval while decoding)."""
    model, _ = fresh
    prompt = _prompt(model.config.vocab_size)
    for chunk in (CHUNK, None):
        plan = Strategy(kv_budget=BUDGET, prefill_chunk=chunk).plan(model)
        kwargs = plan.generate_kwargs()
        assert kwargs.get("prefill_chunk_size") == chunk

        def run(kwargs=kwargs):
            with torch.no_grad():
                model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, **kwargs)

        passes = _passes(model, plan.cache, run)
        interval = plan.cache.layers[0].policy.interval
        most = max(kept_before + read for kept_before, read, _ in passes)
        assert all(kept_after <= BUDGET + interval for *_, kept_after in passes)
        if chunk is None:
            assert most == PROMPT_TOKENS  # one pass reads the whole prompt before it evicts
        else:
            assert [read for _, read, _ in passes[:7]] == [16] * 6 + [4]
            assert most <= BUDGET + CHUNK


def test_generate_with_a_chunked_prompt_gives_the_text_of_a_loop_of_forward_passes(fresh):
    model, _ = fresh
    model.generation_config.eos_token_id = None  # every new token compared, none cut at an end of text
    prompt = _prompt(model.config.vocab_size)
    plan = Strategy(kv_budget=BUDGET, prefill_chunk=CHUNK).plan(model)
    with torch.no_grad():
        output = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                                **plan.generate_kwargs())[0, PROMPT_TOKENS:]  # fmt: skip
        cache, tokens = CompressedCache(model, BUDGET), []
        for start in range(0, PROMPT_TOKENS, CHUNK):
            piece = prompt[:, start : start + CHUNK]
            positions = torch.arange(start, start + piece.shape[1])[None]
            logits = model(input_ids=piece, position_ids=positions, past_key_values=cache).logits
        for step in range(NEW_TOKENS):
            tokens.append(int(logits[0, -1].argmax()))
            position = torch.tensor([[PROMPT_TOKENS + step]])
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=position, past_key_values=cache).logits
    assert output.tolist() == tokens


def _held_through(model, cache, run) -> list[tuple[int, int, bool]]:
    """Per pass through each layer of ``run``: the cache's bytes right before that layer evicts (when it holds the
    most), the tokens that layer has seen, and whether the pass was a replay (forgotten after it)."""
    held = []
    for layer in cache.layers:
        evict = layer.end_pass

        def measured(query_length: int, evict=evict, layer=layer) -> None:
            held.append((cache.memory_bytes(), layer.seen, layer.transient))
            evict(query_length)

        layer.end_pass = measured
    run()
    return held


RECONSTRUCTION_PROMPT, FRACTION = 200, 0.25


def _reconstruction_run(model, prompt, chunk):
    cache = CompressedCache(model, memory_fraction=FRACTION, scoring="reconstruction")
    chunking = {} if chunk is None else {"prefill_chunk_size": chunk}

    def run():
        with torch.no_grad():
            return model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                                  do_sample=False, max_new_tokens=4, **chunking)  # fmt: skip

    return cache, run


def test_a_prompt_read_in_chunks_and_scored_by_reconstruction_holds_its_size_and_one_chunk_at_most(tiny):
    """Each chunk is replayed once read, then evicted: at every moment (replays included) the cache holds at most
    ``memory_fraction`` of a full 16-bit cache of the tokens seen and one chunk's full 16-bit bytes; read in one pass,
    it holds far more."""
    _, tokenizer = tiny
    model = build_model(tokenizer, num_layers=6)
    prompt = torch.randint(3, model.config.vocab_size, (1, RECONSTRUCTION_PROMPT),
                           generator=torch.Generator().manual_seed(1))  # fmt: skip
    one_chunk = full_cache_bytes(model, CHUNK * 2, element_size=2)
    excess = {}
    for chunk in (CHUNK * 2, None):
        cache, run = _reconstruction_run(model, prompt, chunk)
        held = _held_through(model, cache, run)
        assert any(transient for *_, transient in held)  # (the replays were measured too)
        excess[chunk] = max(bytes_ - FRACTION * full_cache_bytes(model, seen, element_size=2)
                            for bytes_, seen, _ in held)  # fmt: skip
    assert excess[CHUNK * 2] <= one_chunk < excess[None]


def test_chunks_as_long_as_the_prompt_read_it_as_one_pass_does(tiny):
    _, tokenizer = tiny
    model = build_model(tokenizer, num_layers=3)
    prompt = torch.randint(3, model.config.vocab_size, (1, RECONSTRUCTION_PROMPT),
                           generator=torch.Generator().manual_seed(2))  # fmt: skip
    outputs, kept = [], []
    for chunk in (None, RECONSTRUCTION_PROMPT):
        cache, run = _reconstruction_run(model, prompt, chunk)
        outputs.append(run()[0].tolist())
        kept.append([layer.kept_positions().tolist() for layer in cache.layers])
    assert outputs[0] == outputs[1] and kept[0] == kept[1]


def test_each_chunk_is_replayed_and_the_entries_held_before_it_keep_the_most_of_their_scores(tiny):
    """Right before a later chunk's eviction, every entry held from earlier chunks scores at least what it scored
    before the chunk came (the replay's attention only adds to the most), and the chunk's own entries were scored by
    its replay (some attention reached them). The earlier entries' scores are zeroed before the last chunk's replay:
    the replay's attention then reaches some of them."""
    _, tokenizer = tiny
    model = build_model(tokenizer, num_layers=2)
    prompt = torch.randint(3, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(3))
    cache = CompressedCache(model, memory_fraction=FRACTION, scoring="reconstruction")
    layer = cache.layers[1]
    snapshots = []  # per chunk: {position: score} after its pass (before its replay), then right before its eviction

    def scores_by_position() -> dict[int, float]:
        stop = layer.longest
        valid = layer.storage.valid(stop)[0, 0]
        positions = layer.storage.read("positions", stop)[0, 0][valid].tolist()
        return dict(zip(positions, layer.storage.read("scores", stop)[0, 0][valid].tolist(), strict=True))

    end_pass, evict = layer.end_pass, layer.evict

    def after_pass(query_length: int) -> None:
        end_pass(query_length)
        if query_length > 1 and not layer.transient:
            if layer.context_start == 64:
                scores = layer.storage.read("scores", layer.longest)
                positions = layer.storage.read("positions", layer.longest)
                layer.storage.write_prefix("scores", torch.where(positions < 64, 0.0, scores))
            snapshots.append(["read", layer.context_start, scores_by_position()])

    def before_eviction(new: int) -> None:
        snapshots.append(["scored", layer.context_start, scores_by_position()])
        evict(new)

    layer.end_pass, layer.evict = after_pass, before_eviction
    with torch.no_grad():
        for start in range(0, 96, 32):
            model(prompt[:, start : start + 32], position_ids=torch.arange(start, start + 32)[None],
                  past_key_values=cache)  # fmt: skip
    kinds = [kind for kind, *_ in snapshots]
    assert kinds == ["read", "scored"] * 3
    for (_, start, read), (_, _, scored) in zip(snapshots[2::2], snapshots[3::2], strict=True):
        earlier = [position for position in read if position < start]
        assert earlier and all(scored[position] >= read[position] for position in earlier)
        own = [position for position in scored if position >= start]
        assert len(own) == 32 and sum(scored[position] for position in own) > 0
    assert any(snapshots[5][2][position] > 0 for position in snapshots[4][2] if position < 64)


def test_after_a_decoding_step_or_end_context_a_pass_of_several_tokens_is_not_replayed(tiny):
    """Until the first decoding step every pass of several tokens is context, replayed once read; after a decoding
    step, or once ``end_context`` says so (a question asked of a compressed document), such a pass is scored as
    decoding steps are. A reset cache reads a new context, replayed as a fresh cache's is."""
    _, tokenizer = tiny
    model = build_model(tokenizer, num_layers=2)
    prompt = torch.randint(3, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(6))

    def replays_of(cache, passes) -> list[bool]:
        """Per pass, whether the tokens were fed again after it (a replay pass forgets its tokens)."""
        layer, replayed = cache.layers[0], []
        forget_last = layer.forget_last
        forgotten = []
        layer.forget_last = lambda count: (forgotten.append(count), forget_last(count))
        for ids, start in passes:
            forgotten.clear()
            with torch.no_grad():
                model(ids, position_ids=torch.arange(start, start + ids.shape[1])[None], past_key_values=cache)
            replayed.append(sum(forgotten) == ids.shape[1])
        layer.forget_last = forget_last
        return replayed

    chunks = [(prompt[:, :32], 0), (prompt[:, 32:48], 32)]
    cache = CompressedCache(model, memory_fraction=FRACTION, scoring="reconstruction", replay="forward")
    assert replays_of(cache, chunks) == [True, True]
    assert replays_of(cache, [(prompt[:, :1], 48), (prompt[:, 1:9], 49)]) == [False, False]
    ended = CompressedCache(model, memory_fraction=FRACTION, scoring="reconstruction", replay="forward")
    replays_of(ended, chunks[:1])
    ended.end_context()
    assert not ended.layers[0].reads_context
    fresh = CompressedCache(model, memory_fraction=FRACTION, scoring="reconstruction", replay="forward")
    replays_of(fresh, chunks[:1])
    ended.reset()
    replays_of(ended, chunks[:1])
    for reset_layer, fresh_layer in zip(ended.layers, fresh.layers, strict=True):
        assert torch.equal(reset_layer.kept_positions(), fresh_layer.kept_positions())
        assert torch.equal(reset_layer.scores(), fresh_layer.scores())


def test_a_continuation_scored_for_perplexity_after_a_context_is_not_replayed(tiny):
    """``continuation_perplexity`` ends the context after its prefill: the replay feeds the context's 64 tokens
    again, not the continuation's 16."""
    from decodekit.eval.perplexity import continuation_perplexity

    _, tokenizer = tiny
    model = build_model(tokenizer, num_layers=2)
    ids = torch.randint(3, model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(7))
    cache = CompressedCache(model, memory_fraction=FRACTION, scoring="reconstruction", replay="forward")
    layer, replayed = cache.layers[0], []
    forget_last = layer.forget_last
    layer.forget_last = lambda count: (replayed.append(count), forget_last(count))
    assert continuation_perplexity(model, cache, ids[:, :64], ids[:, 64:]) > 1
    assert sum(replayed) == 64 and not layer.reads_context


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"prefill_chunk": 0}, "prefill_chunk"),
        ({"prefill_chunk": 1.5}, "prefill_chunk"),
    ],
)
def test_a_bad_prefill_chunk_is_refused_naming_it(values, named):
    with pytest.raises((TypeError, ValueError), match=named):
        Strategy(**values)


def test_the_floor_of_one_token_per_pass_is_allowed_and_reaches_generate():
    assert Strategy(prefill_chunk=1).generate_kwargs()["prefill_chunk_size"] == 1


def test_the_command_line_refuses_a_bad_chunk_in_one_line_before_the_model_loads(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["generate", "hello", "--model", "no-such-model", "--prefill-chunk", "0"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert "--prefill-chunk" in error[-1] and "Traceback" not in "\n".join(error)
