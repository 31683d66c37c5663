"""The processors inside model.generate: sampling, beam search, and the Strategy that builds them."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

from decodekit import (
    FrequencyPresencePenaltyLogitsProcessor,
    MinPLogitsProcessor,
    StagedRepetitionPenaltyLogitsProcessor,
    Strategy,
    encode_prompts,
    generate_text,
)

PROMPTS = ["Tell me about the sea", "Hi"]


def _generate(model, tokenizer, seed=0, max_new_tokens=16, **kwargs):
    batch = encode_prompts(tokenizer, PROMPTS)
    torch.manual_seed(seed)
    output = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **kwargs)
    return output[:, batch["input_ids"].shape[1] :]


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_min_p_sampling_equals_the_built_in_min_p(tiny, temperature):
    model, tokenizer = tiny
    for seed in range(3):
        ours = _generate(
            model,
            tokenizer,
            seed,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            logits_processor=LogitsProcessorList([MinPLogitsProcessor(0.2, temperature=temperature)]),
        )
        built_in = _generate(model, tokenizer, seed, do_sample=True, temperature=temperature, top_k=0, min_p=0.2)
        assert torch.equal(ours, built_in)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_single_stage_penalty_equals_the_built_in_repetition_penalty(tiny, num_beams):
    model, tokenizer = tiny
    ours = _generate(
        model,
        tokenizer,
        num_beams=num_beams,
        do_sample=False,
        logits_processor=LogitsProcessorList([StagedRepetitionPenaltyLogitsProcessor({1: 1.8})]),
    )
    built_in = _generate(model, tokenizer, num_beams=num_beams, do_sample=False, repetition_penalty=1.8)
    assert torch.equal(ours, built_in)


def test_penalties_run_under_beam_search_with_sampling_and_return_sequences(tiny):
    model, tokenizer = tiny
    batch = encode_prompts(tokenizer, PROMPTS)
    processors = LogitsProcessorList(
        [
            StagedRepetitionPenaltyLogitsProcessor([{1: 1.5, 3: 3.0}, {2: 2.0}], window=8),
            FrequencyPresencePenaltyLogitsProcessor([0.5, 1.0], 0.3, prompt_length=batch["input_ids"].shape[1]),
            MinPLogitsProcessor(torch.tensor([0.05, 0.2]), temperature=0.9),
        ]
    )
    output = model.generate(
        **batch,
        max_new_tokens=12,
        num_beams=2,
        num_return_sequences=2,
        do_sample=True,
        temperature=0.9,
        top_k=0,
        logits_processor=processors,
        pad_token_id=tokenizer.pad_token_id,
    )
    assert output.shape[0] == 4


def naive_greedy_with_penalties(model, tokenizer, prompt, steps, frequency, presence):
    """A plain greedy loop, no cache, applying the OpenAI formula in Python."""
    ids = encode_prompts(tokenizer, [prompt])["input_ids"]
    prompt_length = ids.shape[1]
    for _ in range(steps):
        with torch.no_grad():
            logits = model(ids).logits[0, -1].double()
        generated = ids[0, prompt_length:].tolist()
        for token in set(generated):
            logits[token] -= generated.count(token) * frequency + presence
        ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, prompt_length:].tolist()


def test_frequency_presence_in_generate_equals_a_plain_loop(tiny):
    model, tokenizer = tiny
    strategy = Strategy(frequency_penalty=1.5, presence_penalty=0.5)
    batch = encode_prompts(tokenizer, ["Tell me about the sea"])
    output = model.generate(
        **batch,
        max_new_tokens=10,
        min_new_tokens=10,
        **strategy.generate_kwargs(model, prompt_length=batch["input_ids"].shape[1]),
    )
    ours = output[0, batch["input_ids"].shape[1] :].tolist()
    assert ours == naive_greedy_with_penalties(model, tokenizer, "Tell me about the sea", 10, 1.5, 0.5)


def test_strategy_builds_the_processors_in_order():
    strategy = Strategy(
        temperature=0.8,
        min_p=0.1,
        staged_penalty={1: 1.2, 3: 1.5},
        penalty_window=64,
        frequency_penalty=0.2,
        presence_penalty=0.1,
    )
    assert strategy.staged_penalty == "1:1.2,3:1.5"
    processors = strategy.generate_kwargs(prompt_length=5)["logits_processor"]
    assert [type(p).__name__ for p in processors] == [
        "StagedRepetitionPenaltyLogitsProcessor",
        "FrequencyPresencePenaltyLogitsProcessor",
        "MinPLogitsProcessor",
    ]
    assert processors[0].window == 64 and processors[2].temperature.scalar == 0.8


def test_strategy_errors_name_the_field():
    with pytest.raises(ValueError, match="pass prompt_length"):
        Strategy(frequency_penalty=0.5).generate_kwargs()
    with pytest.raises(ValueError, match="penalty_window applies to staged_penalty"):
        Strategy(penalty_window=8)
    with pytest.raises(ValueError, match=r"min_p must be a number in \[0, 1\]"):
        Strategy(min_p=1.5)
    with pytest.raises(ValueError, match="staged_penalty: counts must be strictly increasing"):
        Strategy(staged_penalty={3: 1.5, 1: 1.2})
    with pytest.raises(ValueError, match="only apply when sampling"):
        Strategy(do_sample=False, min_p=0.1)


def test_generate_text_merges_user_processors_with_the_strategys(tiny, monkeypatch):
    model, tokenizer = tiny
    captured = {}
    original = model.generate

    def spy(*args, **kwargs):
        captured.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    user_processor = MinPLogitsProcessor(0.01)
    generate_text(
        model, tokenizer, ["Hi"], Strategy(staged_penalty="1:50"), max_new_tokens=3, logits_processor=[user_processor]
    )
    names = [type(p).__name__ for p in captured["logits_processor"]]
    assert names == ["StagedRepetitionPenaltyLogitsProcessor", "MinPLogitsProcessor"]
    assert captured["logits_processor"][1] is user_processor


def test_cli_flags_reach_the_strategy(tiny_model_dir, capsys):
    from decodekit.cli import main

    argv = [
        "generate",
        "Hello",
        "--model",
        str(tiny_model_dir),
        "--max-new-tokens",
        "6",
        "--no-stream",
        "--staged-penalty",
        "1:1.2,3:1.5",
        "--penalty-window",
        "32",
        "--frequency-penalty",
        "0.3",
        "--presence-penalty",
        "0.2",
        "--min-p",
        "0.05",
        "--temperature",
        "0.8",
        "--seed",
        "3",
    ]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0 and capsys.readouterr().out == first
    assert main(["generate", "Hi", "--staged-penalty", "3:1.5,1:1.2"]) == 2
    assert "counts must be strictly increasing" in capsys.readouterr().err


@pytest.mark.parametrize("chat", [False, True])
def test_a_one_stage_penalty_equals_repetition_penalty_on_a_padded_batch(tiny, chat):
    """Both skip each row's left padding (the pad id is EOS here), so the first step's scores agree bit for bit."""
    model, tokenizer = tiny
    prompts = ["Hi", "The class statement creates a new class object " * 4]
    batch = encode_prompts(tokenizer, prompts, chat=chat)
    assert int((batch["attention_mask"] == 0).sum()) > 0
    common = {"max_new_tokens": 1, "pad_token_id": tokenizer.pad_token_id, "return_dict_in_generate": True}
    ours = model.generate(
        **batch, output_scores=True, **common,
        **Strategy(staged_penalty="1:1.8").generate_kwargs(model, attention_mask=batch["attention_mask"]),
    )  # fmt: skip
    built_in = model.generate(**batch, output_scores=True, do_sample=False, repetition_penalty=1.8, **common)
    assert torch.equal(ours.scores[0], built_in.scores[0])
    texts = generate_text(model, tokenizer, prompts, Strategy(staged_penalty="1:1.8"), max_new_tokens=12, chat=chat)
    reference = generate_text(
        model, tokenizer, prompts, Strategy(), max_new_tokens=12, chat=chat, repetition_penalty=1.8
    )
    assert texts == reference
