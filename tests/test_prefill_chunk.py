"""The prompt read in chunks (``prefill_chunk``, generate's ``prefill_chunk_size``): a compressed cache never holds
more than its size and one chunk, and generate's text equals a loop of forward passes written here."""

from __future__ import annotations

import pytest
import torch

from decodekit import Strategy
from decodekit.cache import CompressedCache
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


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"prefill_chunk": 0}, "prefill_chunk"),
        ({"prefill_chunk": 1.5}, "prefill_chunk"),
        ({"prefill_chunk": 64, "kv_memory_fraction": 0.25, "kv_scoring": "reconstruction"}, "prefill_chunk"),
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
