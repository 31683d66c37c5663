"""Attention statistics under any attention implementation, without touching transformers.

SDPA and flash attention return no attention weights, and a cache's ``update`` never sees the
queries. So decodekit wraps the ``forward`` of each attention module of a model (and of its query
projection) once: when (and only when) the call's ``past_key_values`` is a
:class:`~decodekit.cache.CompressedCache`, the wrapper takes the queries of the last few tokens as
the module's own projection makes them and hands them to the cache layer, gives the module, when
the rows of a batch keep different tokens, the mask that hides each row's dead entries, and after
the module runs lets the layer evict. With any other cache, or none, the wrapper calls the module's
own ``forward`` at once and the forward pass is unchanged.

Where a layer stores its keys coded and rotated by a Hadamard matrix (``kv_bits`` or ``key_bits`` of 2 to 8),
the wrapper of the query projection also hands the module query columns rotated alike
(``rotary.rotated_query_columns``), so that attention reads the keys as coded, without rotating every stored
key back at every pass; scores, and so the module's output, are unchanged (a module with a query norm
between projection and attention keeps its queries, and its keys are rotated back).

A wrapped ``forward`` costs one Python call; a forward hook would send every call of the module
down PyTorch's slower hooked path, about 6% of a decoding step of a small model whose steps are
bound by the host (``benchmarks/kv_cache.py --host-bound``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch
from torch import nn

from decodekit.cache.rotary import rotated_query_columns

HOOKS_ATTRIBUTE = "_decodekit_compression_hooks"
# Set on a module whose forward decodekit wrapped (so that it is never wrapped twice).
WRAPPED_ATTRIBUTE = "_decodekit_wrapped"


def _is_supported_attention(module: nn.Module) -> bool:
    projects_queries = isinstance(getattr(module, "q_proj", None), nn.Module) or isinstance(
        getattr(module, "qkv_proj", None), nn.Linear
    )
    return (
        isinstance(getattr(module, "layer_idx", None), int)
        and projects_queries
        and hasattr(module, "head_dim")
        and hasattr(module, "scaling")
    )


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's self-attention modules, in layer order; ValueError if none is of a supported kind.

    Supported: modules with rotary embeddings and a query projection ``q_proj`` (Llama, Mistral,
    Qwen2, Qwen3 and Gemma 3 with their query norms, SmolLM) or a fused ``qkv_proj`` (Phi-3).
    """
    modules = [module for module in model.modules() if _is_supported_attention(module)]
    if not modules:
        model_type = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
        raise ValueError(
            f"CompressedCache does not support model type {model_type!r}: it needs rotary attention modules "
            "with a query projection (q_proj or a fused qkv_proj), head_dim and scaling, as in Llama, Mistral, "
            "Qwen2, Qwen3, Phi-3, Gemma 3 and SmolLM"
        )
    return sorted(modules, key=lambda module: module.layer_idx)


def _query_projection(module: nn.Module) -> nn.Module:
    """The submodule whose output holds the queries: ``q_proj``, or a fused ``qkv_proj``."""
    projection = getattr(module, "q_proj", None)
    return projection if isinstance(projection, nn.Module) else module.qkv_proj


def bind(model: nn.Module, *, replays: bool = False) -> list[nn.Module]:
    """Wrap the forward of ``model``'s attention modules and query projections once, and, for a cache that
    ``replays`` the prompt (reconstruction scoring), hook the model's own forward; return its attention modules.

    The model's hook is added only for such a cache: it sends every call of the model down PyTorch's hooked
    path, about 1% of a decoding step of a small model whose steps are bound by the host, whatever the cache.
    """
    modules = attention_modules(model)
    installed = getattr(model, HOOKS_ATTRIBUTE, None)
    if installed is None:
        wrapped = []
        for module in modules:
            capture = partial(_capture_queries, module, _queries_maker(module))
            wrapped.append(_wrap_forward(module, partial(_observed_attention, module)))
            wrapped.append(_wrap_forward(_query_projection(module), capture))
        installed = (None, [entry for entry in wrapped if entry is not None])
    if replays and installed[0] is None:
        installed = (model.register_forward_hook(_after_model, with_kwargs=True), installed[1])
    setattr(model, HOOKS_ATTRIBUTE, installed)
    return modules


def unbind(model: nn.Module) -> None:
    """Undo what ``bind`` installed (a CompressedCache then refuses to run on ``model``).

    A module whose forward was wrapped again since (by another library) keeps decodekit's wrapper
    inside that one, and still feeds a CompressedCache; every other module gets its forward back.
    """
    installed = getattr(model, HOOKS_ATTRIBUTE, None)
    if installed is None:
        return
    handle, wrapped = installed
    if handle is not None:
        handle.remove()
    for module, previous, wrapper in wrapped:
        if module.__dict__.get("forward") is not wrapper:
            continue  # wrapped again since: ours stays inside, and the module stays marked
        if previous is None:
            del module.forward  # the class's own forward again
        else:
            module.forward = previous
        delattr(module, WRAPPED_ATTRIBUTE)
    delattr(model, HOOKS_ATTRIBUTE)


def _wrap_forward(module: nn.Module, wrapper) -> tuple[nn.Module, Any, Any] | None:
    """Make ``module.forward`` call ``wrapper(forward, *args, **kwargs)``, with ``forward`` the one it had (a
    library's wrapper, as accelerate's device hooks, stays inside); return what ``unbind`` needs to undo it, or
    None when the module is wrapped already."""
    if getattr(module, WRAPPED_ATTRIBUTE, False):
        return None
    previous = module.__dict__.get("forward")
    wrapped = partial(wrapper, module.forward)
    module.forward = wrapped
    setattr(module, WRAPPED_ATTRIBUTE, True)
    return module, previous, wrapped


def _compressed_cache(kwargs: dict[str, Any]):
    """The call's cache if it is one that observes attention (a ``CompressedCache``), else None."""
    cache = kwargs.get("past_key_values")
    return cache if getattr(cache, "observes_attention", False) else None


def _query_columns(module: nn.Module, projected: torch.Tensor) -> torch.Tensor:
    """The query part of the module's projection output, ``[batch, tokens, heads * head_dim]``: all of it,
    or a copy of a fused projection's first columns (so that the keys and values are not held with it)."""
    if isinstance(getattr(module, "q_proj", None), nn.Module):
        return projected
    return projected[..., : module.config.num_attention_heads * module.head_dim].contiguous()


def queries_from_projection(module: nn.Module, columns: torch.Tensor) -> torch.Tensor:
    """The module's queries from the query columns of its projection (``_query_columns``),
    ``[batch, heads, tokens, head_dim]``, before rotation (after the module's query norm, if it has one)."""
    norm = getattr(module, "q_norm", None)
    return split_heads(columns, module.head_dim, norm if isinstance(norm, nn.Module) else None)


def split_heads(columns: torch.Tensor, head_dim: int, norm: nn.Module | None = None) -> torch.Tensor:
    """Queries ``[batch, heads, tokens, head_dim]`` from query columns ``[batch, tokens, heads * head_dim]``, each
    head's through ``norm`` when given.

    Example:
        >>> split_heads(torch.arange(8.0).view(1, 2, 4), head_dim=2)[0, :, 1].tolist()  # head, then token 1
        [[4.0, 5.0], [6.0, 7.0]]
    """
    batch, length, _ = columns.shape
    queries = columns.reshape(batch, length, -1, head_dim)
    return (queries if norm is None else norm(queries)).transpose(1, 2)


@cache
def _plain_queries(head_dim: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The query maker of every module with this head size and no query norm: one function, shared by the
    layers, so that their waiting queries can be made at once (``joint.evict_together``)."""
    return partial(split_heads, head_dim=head_dim)


def logit_softcap(module: nn.Module) -> float | None:
    """The module's attention logit cap (Gemma 2's), or None."""
    return getattr(module, "attn_logit_softcapping", None)


def queries_can_rotate(module: nn.Module) -> bool:
    """Whether ``module``'s queries can be Hadamard-rotated through its projection's output
    (``rotated_query_columns``): the columns become the queries as they are (no query norm between them)."""
    return not isinstance(getattr(module, "q_norm", None), nn.Module)


def normalizes_keys(module: nn.Module) -> bool:
    """Whether ``module`` normalizes its keys after their projection (a key norm: Gemma 3, Qwen3), whose keys then
    share a large common part that smoothing takes out before coding (``StorageOptions.smooth_keys``)."""
    return isinstance(getattr(module, "k_norm", None), nn.Module)


def _queries_maker(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What makes ``module``'s queries of its query columns (``queries_from_projection``)."""
    if isinstance(getattr(module, "q_norm", None), nn.Module):
        return partial(queries_from_projection, module)
    return _plain_queries(module.head_dim)


def _output_grams(module: nn.Module) -> torch.Tensor:
    """``[heads, head_dim, head_dim]``: each query head's block ``W`` of the output projection, as ``W^T W``."""
    weight = module.o_proj.weight.float()
    blocks = weight.view(weight.shape[0], -1, module.head_dim)  # [hidden, heads, head_dim]
    return torch.einsum("xhd,xhe->hde", blocks, blocks)


def sliding_window(module: nn.Module) -> int | None:
    """The module's local-attention window: its own attribute (per layer type), else its config's."""
    if hasattr(module, "sliding_window"):
        window = module.sliding_window
    else:
        window = getattr(getattr(module, "config", None), "sliding_window", None)
    return window if isinstance(window, int) and window > 0 else None


def _left_padding(attention_mask: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
    """Per row, the left padding of a first forward pass: the leading tokens that may not attend to themselves.

    A real token always sees itself, under causal and sliding-window masks alike; a padding
    token is hidden from every query, itself included.
    """
    if attention_mask is None or attention_mask.dim() != 4:
        return torch.zeros(batch, dtype=torch.long, device=device)
    queries = attention_mask.shape[-2]
    diagonal = attention_mask[:, 0, :, -queries:].diagonal(dim1=-2, dim2=-1)
    hidden = ~diagonal if diagonal.dtype == torch.bool else diagonal < 0
    leading = hidden.to(torch.int32).cumprod(dim=-1).sum(dim=-1)
    return leading.to(device=device, dtype=torch.long).expand(batch).clone()


# The pass each attention module is in, per thread: (layer, observed tokens, (cos, sin)), set before the
# module runs and taken by the wrapper of its query projection, so that the queries are not computed twice.
class _Passes(threading.local):
    """Per thread, the pending passes by attention module id (a fresh dict in each thread)."""

    def __init__(self) -> None:
        self.passes: dict[int, tuple] = {}


_PENDING = _Passes()


def _observed_attention(module: nn.Module, forward, *args, **kwargs):
    """``module``'s forward (``forward``, the one it had), observed when the call's cache is a CompressedCache:
    the layer learns of the pass first (``_before_attention``), and may evict after it."""
    cache = _compressed_cache(kwargs)
    if cache is None:
        return forward(*args, **kwargs)
    hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    layer = cache.layer_for(module)
    mask = _before_attention(module, cache, layer, hidden_states, kwargs)
    if mask is not None:
        kwargs["attention_mask"] = mask
    try:
        output = forward(*args, **kwargs)
    finally:
        _PENDING.passes.pop(id(module), None)  # the queries were not taken if the projection did not run
    layer.end_pass(hidden_states.shape[1])
    return output


def _before_attention(module: nn.Module, cache, layer, hidden_states: torch.Tensor, kwargs: dict[str, Any]):
    """Tell ``layer`` of the coming pass; return the attention mask the module must use instead of the
    model's (None to keep the model's)."""
    position_embeddings = kwargs.get("position_embeddings")
    if position_embeddings is None:
        raise ValueError("CompressedCache needs rotary position embeddings passed to the attention modules")
    batch, length = hidden_states.shape[:2]
    options = cache.options
    if options.replay.output_norms and layer.transient:
        layer.scorer.weigh_replay(1 / hidden_states.float().norm(dim=-1).clamp(min=1e-30), _output_grams(module))
    observed = options.scoring.observation_window
    window = length if observed is None else min(length, observed)
    _PENDING.passes[id(module)] = (layer, window, position_embeddings)
    first_pass = layer.storage is None
    if first_pass:
        pads = _left_padding(kwargs.get("attention_mask"), batch, hidden_states.device)
        visible = layer.begin_pass(length, pads)
    else:
        visible = layer.begin_pass(length)
    if visible is None:
        model_mask = kwargs.get("attention_mask")
        if first_pass or not isinstance(model_mask, torch.Tensor) or layer.reads_step_itself:
            return None
        if model_mask.shape[-1] == layer.get_mask_sizes(length)[0]:
            return None
        # The model's mask was made for another layer's length (allocation="layers"): this layer's own.
        visible = layer.pass_mask(length)
    return _attention_mask(module, visible, hidden_states.dtype)


def _capture_queries(module: nn.Module, to_queries, forward, *args, **kwargs) -> torch.Tensor:
    """The query projection's forward (``forward``), which also hands the layer of a pending pass the observed
    tokens' query columns, as the module's own projection made them, with their rotation; the layer rotates them
    into queries (``to_queries``) when it scores, which a decoding step between evictions does not."""
    output = forward(*args, **kwargs)
    passes = _PENDING.passes
    pending = passes.pop(id(module), None) if passes else None
    if pending is None:
        return output
    layer, window, (cos, sin) = pending
    if layer.coding.rotated_reads:  # the layer's coded keys are read rotated: rotate the queries alike
        output = _with_rotated_queries(module, output, cos, sin)
    observed = output
    if window < observed.shape[1]:
        observed, cos, sin = observed[:, -window:], cos[:, -window:], sin[:, -window:]
    layer.observe(_query_columns(module, observed), to_queries, module.scaling, cos, sin)
    return output


def _with_rotated_queries(module: nn.Module, projected: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The query projection's output with its query columns rotated (``rotated_query_columns``), the others kept."""
    width = _query_width(module)
    rotated = rotated_query_columns(projected[..., :width], module.head_dim, cos, sin)
    return rotated if projected.shape[-1] == width else torch.cat([rotated, projected[..., width:]], dim=-1)


def _query_width(module: nn.Module) -> int:
    """The query columns of ``module``'s projection: its query heads times their size (kept on the module, read at
    every step)."""
    width = module.__dict__.get("_decodekit_query_width")
    if width is None:
        width = module.__dict__["_decodekit_query_width"] = module.config.num_attention_heads * module.head_dim
    return width


def _attention_mask(module: nn.Module, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The layer's ``[batch, kv_heads, queries, keys]`` visibility (boolean, or float logit offsets with -inf where
    hidden: ``biased_mask``) as the mask ``module``'s attention takes."""
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
    if visible.dtype != torch.bool:
        return per_head.to(dtype)
    if implementation == "sdpa":
        return per_head
    return torch.zeros((), dtype=dtype, device=visible.device).masked_fill(~per_head, torch.finfo(dtype).min)


def _after_model(model: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    """After the prompt's forward pass, let a reconstruction-scoring cache replay it and evict."""
    cache = _compressed_cache(kwargs)
    if cache is not None and cache.awaits_prompt_scores:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        cache.after_prompt(model, input_ids)
