"""CompressedCache: a KV cache that keeps a bounded set of tokens chosen by how much attention needs them."""

from __future__ import annotations

import copy
import math
import os
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Self

import torch
from torch import nn
from transformers import Cache

import decodekit.cache.attention as attention
import decodekit.cache.persist as persist
from decodekit.cache.coding import PlainCoding, QuantizedCoding
from decodekit.cache.joint import LayerGroup
from decodekit.cache.layer import CompressedLayer
from decodekit.cache.observer import bind, logit_softcap, normalizes_keys, queries_can_rotate, sliding_window
from decodekit.cache.options import ReplayOptions, ScoringOptions, SizeOptions, StorageOptions, group_options, resolve
from decodekit.cache.policy import EvictionPolicy
from decodekit.cache.scorers import SCORERS
from decodekit.cache.size import attention_head_size, entry_bytes, layer_caps
from decodekit.cache.storage import storage_bytes
from decodekit.settings import CODED_BITS


def _head_dim(model: nn.Module) -> int | None:
    """The model's attention head size, from its config (None when the config does not say)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    return attention_head_size(config.get_text_config() if hasattr(config, "get_text_config") else config)


class CompressedCache(Cache):
    """A KV cache for ``model.generate(past_key_values=...)`` that keeps, per layer, row and KV head, the first
    ``sink_tokens`` tokens, the last ``recent_tokens`` and the best-ranked of the rest, within a size.

    The options come in four groups, each also open to its own keywords (``CompressedCache(model,
    memory_fraction=0.25, scoring="reconstruction")``):

    - ``size`` (:class:`SizeOptions`): ``budget`` (tokens per layer, row and KV head), ``compression_ratio`` (the
      share of the tokens seen evicted), ``memory_fraction`` (of a full 16-bit cache's bytes) or ``max_bytes``;
      ``sink_tokens`` (4), ``recent_tokens`` (32), ``eviction_interval`` (tokens a decoding step evicts at once) and
      ``allocation`` ("uniform", "layers" or "heads": how the size is shared).
    - ``scoring`` (:class:`ScoringOptions` or its method's name): "attention" (the attention a token receives,
      decayed by ``score_decay`` between passes, times its value's norm), "reconstruction" (the most attention a
      replay of the prompt pays it: query-agnostic, as KVzip) or "attention+novelty"; ``observation_window``,
      ``pool_kernel``, ``value_norm``, ``scoring_backend``, ``matched_layers``.
    - ``storage`` (:class:`StorageOptions`): ``kv_bits`` (16, 8, 5, 4, 3 or 2), ``key_bits``, ``kv_group_size``,
      ``residual_length``, ``smooth_keys`` (coded keys less their mean key; by default where the model normalizes
      its keys).
    - ``replay`` (:class:`ReplayOptions` or its mode's name): how reconstruction scores are had.

    The cache is bound to ``model``, whose attention modules it observes through wrapped forwards that do nothing
    more than call the module's own when another cache (or none) is used. Positions stay logical:
    ``get_seq_length()`` is the number of tokens seen. Padding is not content: a row's size counts its real tokens
    only, so each row of a left-padded batch decodes what it decodes alone.

    Example (with ``model`` and ``batch`` from ``load_model``/``encode_prompts``)::

        from decodekit.cache import CompressedCache
        cache = CompressedCache(model, memory_fraction=0.25, scoring="reconstruction")
        output = model.generate(**batch, past_key_values=cache, max_new_tokens=256)
        print(cache.get_seq_length(), cache.kept_tokens, cache.memory_bytes())
    """

    observes_attention = True  # the attention observer feeds this cache (and only caches that say so)

    def __init__(
        self,
        model: nn.Module,
        budget: int | None = None,
        *,
        size: SizeOptions | None = None,
        scoring: str | ScoringOptions = "attention",
        storage: StorageOptions | None = None,
        replay: str | ReplayOptions = "auto",
        **options,
    ) -> None:
        try:
            grouped = group_options(budget, {"size": size, "scoring": scoring, "storage": storage,
                                             "replay": replay}, options)  # fmt: skip
        except ValueError as error:
            raise ValueError(_naming_windows(str(error), model)) from None
        head_dim = _head_dim(model)
        scorer_class = SCORERS[grouped["scoring"].method]
        modules = bind(model, replays=scorer_class.replays)
        windows = [sliding_window(module) for module in modules]
        sliding_windows = any(window is not None for window in windows)
        self.options = resolved = resolve(grouped, head_dim, sliding_windows)
        if resolved.storage.smooth_keys is None:  # (by the model: where it normalizes its keys)
            smooth = any(normalizes_keys(module) for module in modules)
            self.options = resolved = replace(resolved, storage=replace(resolved.storage, smooth_keys=smooth))
        size, stored = resolved.size, resolved.storage
        by_bytes = None
        if size.in_bytes:
            by_bytes = entry_bytes(
                model, kv_bits=stored.kv_bits, key_bits=stored.key_bits, group_size=stored.group_size,
                residual_length=stored.residual_length, eviction_interval=size.eviction_interval,
                value_norms=resolved.ranks_by_value_norm, matched_layers=resolved.scoring.matched_layers,
                caps=tuple(math.inf if window is None else window - 1 for window in windows),
                smooth_keys=stored.smooth_keys,
            )  # fmt: skip
        self.policy = EvictionPolicy(size, by_bytes)
        if by_bytes is not None:
            self.policy.check_room(windows)
        self._layer_of_module = {id(module): index for index, module in enumerate(modules)}
        layers = []
        for index, module in enumerate(modules):
            coding = _coding(stored)
            keys_coded = coding.quantized and coding.quantizers["keys"] is not None
            coding.rotated_reads = keys_coded and queries_can_rotate(module)
            layer = CompressedLayer(resolved, self.policy, scorer_class(resolved), coding,
                                    matched=index < resolved.scoring.matched_layers, window=windows[index],
                                    softcap=logit_softcap(module))  # fmt: skip
            layer.waits_for_prompt_scores = scorer_class.replays
            layer.module = weakref.ref(module)
            layers.append(layer)
        alike = size.allocation == "uniform" and resolved.scoring.matched_layers == 0  # (fields and shapes alike)
        if alike and not resolved.sliding_windows:  # (the layers evict together: joint.py)
            group = LayerGroup(layers)
            for layer in layers:
                layer.join(group)
        attention.install()
        super().__init__(layers=layers)
        self._model = weakref.ref(model)
        self.token_ids: list[int] | None = None  # the tokens the cache was filled with, where a caller said (``save``)

    def layer_for(self, module: nn.Module) -> CompressedLayer:
        """The cache layer that serves attention ``module``; ValueError for another model's module."""
        index = self._layer_of_module.get(id(module))
        if index is None:
            raise ValueError(
                "this CompressedCache was built for another model: create one with CompressedCache(model, ...)"
            )
        return self.layers[index]

    @property
    def awaits_prompt_scores(self) -> bool:
        """Whether the prompt has passed and its scores are still to come (``scoring="reconstruction"``)."""
        first = self.layers[0] if self.layers else None
        return first is not None and first.waits_for_prompt_scores and first.storage is not None and not first.transient

    def end_context(self) -> None:
        """Say that the context is complete: from now on a pass of several tokens (a question asked of a compressed
        document) is scored as decoding steps are, not replayed (``scoring="reconstruction"`` replays every pass of
        several tokens until the first decoding step: the prompt, or each of its chunks). ``fill`` ends it; a loaded
        cache continues as the one saved.

        Example (with ``model`` and a tokenized document ``ids``)::

            cache = CompressedCache(model, memory_fraction=0.1, scoring="reconstruction")
            for start in range(0, ids.shape[1], 512):  # the document in chunks, each replayed once read
                model(ids[:, start : start + 512], past_key_values=cache)
            cache.end_context()  # a question now is not part of the document
        """
        for layer in self.layers:
            layer.reads_context = False

    def after_prompt(self, model: nn.Module, input_ids: torch.Tensor | None) -> None:
        """After the prompt's pass: let the scorer score it (a replay of the prompt), then evict."""
        self.layers[0].scorer.after_prompt(self, model, input_ids)

    def save(
        self, path: str | os.PathLike, token_ids: Sequence[int] | None = None, *, metadata: Mapping | None = None
    ) -> Path:
        """Write this cache to ``path`` (safetensors and a JSON header, no pickle; atomically: a save stopped midway
        leaves no file): every layer's kept entries as stored, the options, and what a later ``load`` checks (the
        model's identity and weights' fingerprint, the dtype, the format's version, a checksum of the contents).
        ``token_ids``: the tokens the cache was filled with, one list per row for several rows, padding included
        (default: ``self.token_ids``), recorded so that a caller can check a document's ids; ValueError unless each
        row holds as many as the cache has seen. ``metadata``: the caller's own notes (JSON), read back with
        ``persist.read_header(path)["metadata"]``.

        Example (with ``model`` and a tokenized document ``ids``)::

            cache = CompressedCache(model, memory_fraction=0.1, scoring="reconstruction")
            model(ids, past_key_values=cache)
            cache.save("doc.kv", token_ids=ids[0].tolist())
            answer_from = CompressedCache.load("doc.kv", model).fork()  # one fork per question
        """
        model = self._model()
        if model is None:
            raise ValueError("the model this CompressedCache was built for is gone: it cannot be saved")
        token_ids = self.token_ids if token_ids is None else token_ids
        return persist.save(self, path, model, token_ids, metadata)

    @classmethod
    def load(cls, path: str | os.PathLike, model: nn.Module, device: torch.device | str | None = None) -> Self:
        """A cache rebuilt from a file ``save`` wrote, bound to ``model`` (on ``device``, default the model's). A file
        made for another model or checkpoint, another dtype, in a newer format, truncated or corrupted is refused with
        a ValueError naming what does not match."""
        return persist.load(cls, path, model, device)

    def fork(self) -> Self:
        """An independent copy, bound to the same model: ask one question of a compressed document per fork, and the
        document stays as it was for the next."""
        return copy.deepcopy(self)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Queries follow the stored entries physically (the attention mask is built on stored entries); inside a
        compiled step, the step's token is the last of the capacity attention reads."""
        layer = self.layers[layer_idx]
        if torch.compiler.is_compiling() and layer.storage is not None:
            return layer.storage.capacity - 1
        return layer.longest

    def memory_bytes(self) -> int:
        """Bytes the cache holds now: every storage behind its layers' tensors, each counted once (keys, values,
        their scales and bookkeeping, room for the next tokens, the residual window, waiting steps' queries)."""
        return sum(storage_bytes(tensor for layer in self.layers for tensor in layer.held_tensors()).values())

    @property
    def kept_tokens(self) -> int:
        """The most tokens any row keeps per layer and KV head (padding never counts)."""
        return max((layer.kept for layer in self.layers), default=0)


def _naming_windows(message: str, model: nn.Module) -> str:
    """A refused budget's message, naming the model's sliding window where it has one (a layer whose window is
    shorter than the floor holds its window whatever the budget; the others hold the budget)."""
    if not message.startswith("budget must be"):
        return message
    caps = layer_caps(model.config)
    windowed = [cap for cap in caps if cap != math.inf]
    if not windowed:
        return message
    return (f"{message}: this model's sliding window holds {int(min(windowed))} tokens in {len(windowed)} of its "
            f"{len(caps)} layers, which keep their window under any larger budget")


def _coding(stored: StorageOptions):
    """A layer's coding for these storage options."""
    if not stored.coded:
        return PlainCoding(stored.kv_bits)
    key_bits = stored.key_bits or stored.kv_bits
    return QuantizedCoding(key_bits if key_bits in CODED_BITS else None,
                           stored.kv_bits if stored.kv_bits in CODED_BITS else None,
                           stored.group_size, stored.residual_length, stored.smooth_keys)  # fmt: skip
