"""A tiny random Llama-architecture model and a tokenizer, built in-process in seconds.

The tokenizer is a byte-level BPE trained on a few KB of the standard library's own text, with
SmolLM2's chat tokens and chat template, so the code paths match the real default model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 384


def _training_text() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)[:40]]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with ``VOCAB_SIZE`` entries and SmolLM2-style chat tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_training_text(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer: PreTrainedTokenizerFast, *, seed: int = 0, num_layers: int = 2) -> LlamaForCausalLM:
    """A random Llama with grouped-query attention (4 query heads, 2 KV heads)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    # Untied, wider output head: random tied embeddings would make the model echo its last
    # token, and the default init gives near-uniform logits whose top token is rounding noise.
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
    return model.eval()


def save_tiny_model(directory: Path) -> Path:
    """Build the tiny model and tokenizer and save both to ``directory``."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
