"""Prompt encoding and text generation helpers."""

from __future__ import annotations

import pytest

from decodekit import Strategy, encode_prompts, generate_text


def test_chat_template_is_used_when_the_tokenizer_has_one(tiny):
    _, tokenizer = tiny
    batch = encode_prompts(tokenizer, ["Hello"], system_prompt="Be brief.")
    text = tokenizer.decode(batch["input_ids"][0])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_empty_system_prompt_keeps_the_templates_own(tiny):
    _, tokenizer = tiny
    text = tokenizer.decode(encode_prompts(tokenizer, ["Hello"], system_prompt="")["input_ids"][0])
    assert text.startswith("<|im_start|>system\nYou are a tiny test model<|im_end|>")


def test_raw_prompts_are_sent_as_is(tiny):
    _, tokenizer = tiny
    batch = encode_prompts(tokenizer, ["Hello there"], chat=False)
    assert tokenizer.decode(batch["input_ids"][0]) == "Hello there"


def test_batches_are_left_padded(tiny):
    _, tokenizer = tiny
    batch = encode_prompts(tokenizer, ["Hi", "A much longer prompt than the first"], chat=False)
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][0, -1] == 1
    assert batch["attention_mask"][1].all()


@pytest.mark.parametrize("prompts", [[], [""], ["ok", "   "]])
def test_empty_prompts_are_refused(tiny, prompts):
    _, tokenizer = tiny
    with pytest.raises(ValueError, match="prompts"):
        encode_prompts(tokenizer, prompts)


@pytest.mark.parametrize("max_new_tokens", [0, -3, 2.5])
def test_max_new_tokens_below_one_is_refused(tiny, max_new_tokens):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        generate_text(model, tokenizer, ["Hi"], max_new_tokens=max_new_tokens)


def test_batched_greedy_equals_one_prompt_at_a_time(tiny):
    model, tokenizer = tiny
    prompts = ["Hi", "Tell me a long story about the sea"]
    batched = generate_text(model, tokenizer, prompts, Strategy(), max_new_tokens=10)
    alone = [generate_text(model, tokenizer, [prompt], Strategy(), max_new_tokens=10)[0] for prompt in prompts]
    assert batched == alone
    assert all(batched)
