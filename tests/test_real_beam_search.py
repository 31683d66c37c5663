"""decodekit's beam search on the embedded default model against the built-in one (marked slow)."""

from __future__ import annotations

import pytest
import torch

from decodekit import encode_prompts
from decodekit.decoders import beam_search

pytestmark = pytest.mark.slow
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three fruits."]


@pytest.mark.parametrize("num_beams", [2, 4, 8])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_average_normalization_equals_the_built_in_on_the_real_model(real, num_beams, batch_size):
    model, tokenizer = real
    batch = encode_prompts(tokenizer, PROMPTS[:batch_size])
    kwargs = {
        "num_beams": num_beams,
        "num_return_sequences": 2,
        "max_new_tokens": 20,
        "pad_token_id": tokenizer.pad_token_id,
        "return_dict_in_generate": True,
        "output_scores": True,
        "length_penalty": 1.0,
    }
    built_in = model.generate(**batch, **kwargs)
    ours = model.generate(**batch, custom_generate=beam_search, **kwargs)
    assert torch.equal(ours.sequences, built_in.sequences)
    torch.testing.assert_close(ours.sequences_scores, built_in.sequences_scores, atol=1e-4, rtol=0)


def test_gnmt_normalization_answers_sensibly(real):
    model, tokenizer = real
    batch = encode_prompts(tokenizer, ["What is the capital of France?"])
    output = model.generate(
        **batch,
        custom_generate=beam_search,
        num_beams=4,
        length_normalization="gnmt",
        length_alpha=0.6,
        max_new_tokens=16,
        pad_token_id=tokenizer.pad_token_id,
    )
    text = tokenizer.decode(output[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text
