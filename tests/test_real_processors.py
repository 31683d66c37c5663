"""The processors on the embedded default model (marked slow)."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

from decodekit import MinPLogitsProcessor, StagedRepetitionPenaltyLogitsProcessor, Strategy, encode_prompts

pytestmark = pytest.mark.slow
PROMPTS = ["List five fruits.", "Write one sentence about the moon."]


def _new_tokens(model, tokenizer, seed=0, **kwargs):
    batch = encode_prompts(tokenizer, PROMPTS)
    torch.manual_seed(seed)
    output = model.generate(**batch, max_new_tokens=24, pad_token_id=tokenizer.pad_token_id, **kwargs)
    return output[:, batch["input_ids"].shape[1] :]


def test_single_stage_penalty_equals_built_in_repetition_penalty(real):
    model, tokenizer = real
    ours = _new_tokens(
        model,
        tokenizer,
        do_sample=False,
        logits_processor=LogitsProcessorList([StagedRepetitionPenaltyLogitsProcessor({1: 1.3})]),
    )
    assert torch.equal(ours, _new_tokens(model, tokenizer, do_sample=False, repetition_penalty=1.3))


def test_min_p_sampling_equals_built_in_min_p(real):
    model, tokenizer = real
    for seed in range(2):
        ours = _new_tokens(
            model,
            tokenizer,
            seed,
            do_sample=True,
            temperature=0.8,
            top_k=0,
            logits_processor=LogitsProcessorList([MinPLogitsProcessor(0.1, temperature=0.8)]),
        )
        assert torch.equal(
            ours, _new_tokens(model, tokenizer, seed, do_sample=True, temperature=0.8, top_k=0, min_p=0.1)
        )


def test_staged_penalty_reduces_repetition(real):
    model, tokenizer = real
    batch = encode_prompts(tokenizer, ["Repeat the word 'hello' many times."])
    plain = model.generate(**batch, max_new_tokens=40, do_sample=False)[0, batch["input_ids"].shape[1] :]
    kwargs = Strategy(staged_penalty="1:1.3,3:2.0,6:4.0", penalty_window=64).generate_kwargs(model)
    penalized = model.generate(**batch, max_new_tokens=40, **kwargs)[0, batch["input_ids"].shape[1] :]
    assert len(set(penalized.tolist())) > len(set(plain.tolist()))
