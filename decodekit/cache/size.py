"""How many bytes a full (uncompressed) KV cache holds: the baseline a compressed cache is judged by."""

from __future__ import annotations

from typing import Any


def full_cache_bytes(model: Any, tokens: int, rows: int = 1) -> int:
    """The bytes a full KV cache of ``tokens`` tokens per row holds for ``model`` (keys and values,
    every layer and KV head, in the model's parameter dtype).

    Example:
        >>> from types import SimpleNamespace
        >>> import torch
        >>> config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=4, head_dim=8)
        >>> config.get_text_config = lambda: config
        >>> model = SimpleNamespace(config=config, parameters=lambda: iter([torch.zeros(1)]))
        >>> full_cache_bytes(model, tokens=10)  # 2 (K and V) * 2 layers * 4 heads * 8 * 10 tokens * 4 bytes
        5120
    """
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * tokens * rows * element
