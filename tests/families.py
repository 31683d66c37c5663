"""Tiny random models of each family the compressed cache supports, built in-process."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 384
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "pad_token_id": 2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
# name -> (model class, config); each exercises one kind of attention module.
FAMILIES = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**COMMON)),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**COMMON, sliding_window=None)),
    "mistral-sliding": (MistralForCausalLM, lambda: MistralConfig(**COMMON, sliding_window=10)),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**COMMON)),  # biased projections
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**COMMON, head_dim=16)),  # query and key norms
    "phi3": (Phi3ForCausalLM, lambda: Phi3Config(**COMMON, sliding_window=None, partial_rotary_factor=0.5)),
    "gemma3": (
        Gemma3ForCausalLM,
        lambda: Gemma3TextConfig(
            **COMMON,
            head_dim=16,
            sliding_window=10,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
        ),
    ),
}


def build_family_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A random two-layer model of family ``name`` (a key of FAMILIES) in eval mode, SDPA attention."""
    model_class, config = FAMILIES[name]
    torch.manual_seed(seed)
    model = model_class(config())
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)  # spread logits so greedy picks are not rounding noise
    return model.eval()
