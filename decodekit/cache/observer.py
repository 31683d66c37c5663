"""Attention statistics under any attention implementation, without touching transformers.

SDPA and flash attention return no attention weights, and a cache's ``update`` never sees the
queries. So decodekit hooks each attention module of a model once: before the module runs, if
(and only if) its ``past_key_values`` is a :class:`~decodekit.cache.CompressedCache`, the hook
recomputes the queries of the last few tokens (one small projection) and hands them to the cache
layer, and, when the rows of a batch keep different tokens, gives the module the mask that hides
each row's dead entries; after the module runs, it lets the layer evict. With any other cache, or
none, the hooks return at once and the forward pass is unchanged.
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


def _before_attention(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
    cache = _compressed_cache(kwargs)
    if cache is None:
        return None
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    position_embeddings = kwargs.get("position_embeddings")
    if position_embeddings is None:
        raise ValueError("CompressedCache needs rotary position embeddings passed to the attention modules")
    layer = cache.layer_for(module)
    length = hidden_states.shape[1]
    window = length if cache.policy.observation_window is None else min(length, cache.policy.observation_window)
    observed = hidden_states[:, -window:]
    batch = observed.shape[0]
    queries = module.q_proj(observed).view(batch, window, -1, module.head_dim)
    if isinstance(getattr(module, "q_norm", None), nn.Module):
        queries = module.q_norm(queries)
    queries = queries.transpose(1, 2)
    cos, sin = (embedding[:, -window:].unsqueeze(1) for embedding in position_embeddings)
    queries = queries * cos + _rotate_half(queries) * sin
    pads = None
    if not layer.is_initialized:
        pads = _left_padding(kwargs.get("attention_mask"), batch, queries.device)
    layer.observe(queries, module.scaling, pads)
    visible = layer.pass_mask(length)
    if visible is None:
        return None
    kwargs["attention_mask"] = _attention_mask(module, visible, queries.dtype)
    return args, kwargs


def _attention_mask(module: nn.Module, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The layer's ``[batch, kv_heads, queries, keys]`` visibility as the mask ``module``'s attention takes."""
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None) or "sdpa"
    if implementation not in ("sdpa", "eager"):
        raise ValueError(
            f"CompressedCache needs attn_implementation 'sdpa' or 'eager' when rows keep different tokens "
            f"(a left-padded batch, or after crop); this model uses {implementation!r}: load it with "
            "attn_implementation='sdpa', or generate one prompt at a time"
        )
    batch, kv_heads, queries, keys = visible.shape
    group = module.config.num_attention_heads // kv_heads
    per_head = visible[:, :, None].expand(batch, kv_heads, group, queries, keys).reshape(batch, -1, queries, keys)
    if implementation == "sdpa":
        return per_head
    return torch.zeros((), dtype=dtype, device=visible.device).masked_fill(~per_head, torch.finfo(dtype).min)


def _after_attention(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    cache = _compressed_cache(kwargs)
    if cache is not None:
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cache.layer_for(module).compress(hidden_states.shape[1])
