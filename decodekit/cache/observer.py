"""Attention statistics under any attention implementation, without touching transformers.

SDPA and flash attention return no attention weights, and a cache's ``update`` never sees the
queries. So decodekit hooks each attention module of a model once: before the module runs, if
(and only if) its ``past_key_values`` is a :class:`~decodekit.cache.CompressedCache`, the hook
recomputes the queries of the last few tokens (one small projection) and hands them to the cache
layer; after the module runs, it lets the layer evict. With any other cache, or none, the hooks
return at once and the forward pass is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

HOOKS_ATTRIBUTE = "_decodekit_compression_hooks"


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's self-attention modules, in layer order; ValueError if they are not Llama-style."""
    modules = [
        module
        for module in model.modules()
        if isinstance(getattr(module, "layer_idx", None), int)
        and isinstance(getattr(module, "q_proj", None), nn.Module)
        and hasattr(module, "head_dim")
        and hasattr(module, "scaling")
    ]
    if not modules:
        raise ValueError(
            f"CompressedCache supports models with Llama-style attention modules (q_proj, head_dim, scaling, "
            f"layer_idx), such as Llama, Mistral, Qwen2/3 and SmolLM; {type(model).__name__} has none"
        )
    return sorted(modules, key=lambda module: module.layer_idx)


def bind(model: nn.Module) -> list[nn.Module]:
    """Install the observation hooks on ``model`` once; return its attention modules."""
    modules = attention_modules(model)
    if getattr(model, HOOKS_ATTRIBUTE, None) is None:
        handles = []
        for module in modules:
            handles.append(module.register_forward_pre_hook(_before_attention, with_kwargs=True))
            handles.append(module.register_forward_hook(_after_attention, with_kwargs=True))
        setattr(model, HOOKS_ATTRIBUTE, handles)
    return modules


def unbind(model: nn.Module) -> None:
    """Remove the hooks that ``bind`` installed (a CompressedCache then refuses to run on ``model``)."""
    for handle in getattr(model, HOOKS_ATTRIBUTE, None) or []:
        handle.remove()
    if hasattr(model, HOOKS_ATTRIBUTE):
        delattr(model, HOOKS_ATTRIBUTE)


def _compressed_cache(kwargs: dict[str, Any]):
    from decodekit.cache.compressed import CompressedCache

    cache = kwargs.get("past_key_values")
    return cache if isinstance(cache, CompressedCache) else None


def _rotate_half(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _left_padding(attention_mask: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
    """Per row, how many keys the last query may not see: the left padding of a first forward pass."""
    if attention_mask is None or attention_mask.dim() != 4:
        return torch.zeros(batch, dtype=torch.long, device=device)
    last_query = attention_mask[:, 0, -1, :]
    hidden = ~last_query if last_query.dtype == torch.bool else last_query < 0
    return hidden.sum(dim=-1).to(device=device, dtype=torch.long).expand(batch).clone()


def _before_attention(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    cache = _compressed_cache(kwargs)
    if cache is None:
        return
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    position_embeddings = kwargs.get("position_embeddings")
    if position_embeddings is None:
        raise ValueError("CompressedCache needs rotary position embeddings passed to the attention modules")
    layer = cache.layer_for(module)
    window = hidden_states.shape[1]
    if cache.policy.observation_window is not None:
        window = min(window, cache.policy.observation_window)
    observed = hidden_states[:, -window:]
    batch = observed.shape[0]
    queries = module.q_proj(observed).view(batch, window, -1, module.head_dim)
    if isinstance(getattr(module, "q_norm", None), nn.Module):
        queries = module.q_norm(queries)
    queries = queries.transpose(1, 2)
    cos, sin = (embedding[:, -window:].unsqueeze(1) for embedding in position_embeddings)
    queries = queries * cos + _rotate_half(queries) * sin
    pads = None
    if layer.pads is None:
        pads = _left_padding(kwargs.get("attention_mask"), batch, queries.device)
        cache.check_padding(pads)
    layer.observe(queries, module.scaling, pads)


def _after_attention(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    cache = _compressed_cache(kwargs)
    if cache is not None:
        cache.layer_for(module).compress()
