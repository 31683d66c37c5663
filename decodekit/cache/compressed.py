"""CompressedCache: a KV cache that keeps a bounded set of tokens chosen by the attention they receive."""

from __future__ import annotations

import math
from collections.abc import Sequence
from inspect import signature

import torch
from torch import nn
from transformers import Cache

from decodekit.cache.allocation import layer_counts
from decodekit.cache.heads import HeadsLayer
from decodekit.cache.joint import SharedRoom
from decodekit.cache.layer import CompressedLayer
from decodekit.cache.observer import bind, queries_can_turn
from decodekit.cache.policy import EvictionPolicy, default_eviction_interval
from decodekit.cache.quantize import Quantizer
from decodekit.cache.scoring import rank_fractions
from decodekit.cache.size import attention_head_size, entry_bytes
from decodekit.cache.storage import storage_bytes
from decodekit.settings import CODED_BITS

# The least memory fraction at which a byte-sized cache stores keys in 8 bits and values in 4, per allocation; under
# "heads", the least at which it stores keys in 5 bits (else both in 4); and the exact residual it holds: chosen on
# the tuning texts with ``benchmarks/kv_bytes.py`` (see ``byte_sized_widths`` and ``byte_sized_residual``).
KEYS_IN_8_BITS_FROM = {"uniform": 0.45, "global": 0.2, "heads": 0.45}
KEYS_IN_5_BITS_FROM = {"heads": 0.1}
RESIDUAL_WHEN_SIZED_IN_BYTES = {"heads": 0}  # absent: recent_tokens
INTERVAL_WHEN_SIZED_IN_BYTES = {"heads": 1}  # absent: default_eviction_interval(None), 8


# How many of the first layers refit their prompt's kept entries (``matched_layers``), per scoring, when told none.
MATCHED_LAYERS = {"reconstruction": 1}


def default_matched_layers(scoring: str) -> int:
    """The ``matched_layers`` of a cache told none: ``MATCHED_LAYERS`` of its scoring, else 0 (refitting needs the
    prompt's queries placed after it, which only reconstruction scoring places). With reconstruction scoring, the
    first layer: chosen on the tuning texts with ``benchmarks/kv_bytes.py --matched-layers``, where it lowered the
    mean perplexity rise at every size (+1.52% to +0.79% with 75% of the tokens evicted, +1.45% to +0.80% at a
    tenth of the bytes) and two layers did no better.

    Example:
        >>> default_matched_layers("attention"), default_matched_layers("reconstruction")
        (0, 1)
    """
    return MATCHED_LAYERS.get(scoring, 0)


def byte_sized_widths(
    memory_fraction: float | None, allocation: str = "uniform", head_dim: int | None = None
) -> tuple[int, int]:
    """``(kv_bits, key_bits)`` for a cache sized in bytes and told no widths: keys in 8 bits and values in 4
    while evicting costs more than coarser codes, else both in 4 (more tokens beat more bits once many
    tokens must go). Chosen on the tuning texts with ``benchmarks/kv_bytes.py``, of 16, 8/4 and 4 bits
    (and 8 for "uniform"): "uniform" (attention scoring): 8/4 best at 50%, 4 at 25% and 10%, so 8/4
    from 45% up; "global": 8/4 best at 50% and 25%, 4 at 10%, so from 20%; "heads" (keys coded after a
    Hadamard rotation): 4 best of those at 25%, 10% and 5%, so 8/4 only from 45% up, where it holds nearly
    every token. Under "heads", keys in 5 bits and values in 4 then beat both in 4 over the eight tuning texts
    (``--texts tuning`` and ``tuning2``) at 25% (+0.26% mean, +0.75% on the worst text, against +0.63% and +1.46%)
    and 10% (+1.19%, +2.77% against +1.36%, +3.00%), not at 5% (+4.39%, +9.07% against +4.10%, +9.16%), so from
    10% up. 5-bit codes pack eight channels at a time: a ``head_dim`` that is not a multiple of 8 takes 4 bits.

    Example:
        >>> byte_sized_widths(0.5), byte_sized_widths(0.25), byte_sized_widths(None)
        ((4, 8), (4, 4), (4, 4))
        >>> byte_sized_widths(0.25, "global"), byte_sized_widths(0.1, "global")
        ((4, 8), (4, 4))
        >>> byte_sized_widths(0.5, "heads"), byte_sized_widths(0.25, "heads"), byte_sized_widths(0.05, "heads")
        ((4, 8), (4, 5), (4, 4))
        >>> byte_sized_widths(0.25, "heads", head_dim=64), byte_sized_widths(0.25, "heads", head_dim=12)
        ((4, 5), (4, 4))
    """
    if memory_fraction is None:
        return 4, 4
    if memory_fraction >= KEYS_IN_8_BITS_FROM.get(allocation, 0.45):
        return 4, 8
    packs_five = head_dim is None or head_dim % 8 == 0
    return 4, 5 if packs_five and memory_fraction >= KEYS_IN_5_BITS_FROM.get(allocation, math.inf) else 4


def byte_sized_residual(allocation: str, recent_tokens: int) -> int:
    """The ``residual_length`` of a cache sized in bytes and told none: none under ``allocation="heads"``,
    where the bytes of 32 exact tokens per head held more tokens instead and lost less (tuning texts, 4 bits:
    +0.28% against +0.30% at 25% of the bytes, +1.57% against +1.92% at 10%); else ``recent_tokens``.

    Example:
        >>> byte_sized_residual("heads", 32), byte_sized_residual("uniform", 32)
        (0, 32)
    """
    return RESIDUAL_WHEN_SIZED_IN_BYTES.get(allocation, recent_tokens)


def byte_sized_interval(allocation: str) -> int:
    """The ``eviction_interval`` of a cache sized in bytes and told none: 1 under ``allocation="heads"``, where the
    bytes the waiting decoding steps' queries would hold went to more tokens and lost less (tuning texts, 4 bits,
    no residual: +2.74% against +3.35% at 5% of the bytes, +1.45% against +1.57% at 10%), at the cost of
    bookkeeping at every decoding step; else 8.

    Example:
        >>> byte_sized_interval("heads"), byte_sized_interval("uniform")
        (1, 8)
    """
    return INTERVAL_WHEN_SIZED_IN_BYTES.get(allocation, default_eviction_interval(None))


def _head_dim(model: nn.Module) -> int | None:
    """The model's attention head size, from its config (None when the config does not say)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    return attention_head_size(config.get_text_config() if hasattr(config, "get_text_config") else config)


def _union_of_ranks(attention: torch.Tensor, replay: torch.Tensor) -> torch.Tensor:
    """Per row and head, each entry's better rank (a fraction in [0, 1)) under two scores, on the scale of
    ``attention`` so that the attention later queries add keeps its weight."""
    better = torch.maximum(rank_fractions(attention), rank_fractions(replay)).to(attention.dtype)
    return better * attention.mean(dim=-1, keepdim=True) / better.mean(dim=-1, keepdim=True).clamp(min=1e-30)


class CompressedCache(Cache):
    """A KV cache for ``model.generate(past_key_values=...)`` that evicts low-attention tokens.

    Per layer, row and KV head it keeps the first ``sink_tokens`` tokens (attention sinks), the
    last ``recent_tokens``, and the tokens with the highest importance, up to a size set by
    ``budget`` (a token count, held after prefill and throughout decoding) or
    ``compression_ratio`` (keep ``1 - ratio`` of the tokens seen so far). A token's importance is
    the attention it receives, averaged over the queries that can see it (all queries of each
    forward pass, or the last ``observation_window``) and over the query heads sharing its KV
    head, plus its earlier score times ``score_decay``; eviction ranks it times the norm of its
    value vector. The tokens of one forward pass attend to the kept cache and to all of
    themselves; eviction follows.

    Memory: with a budget, each row and KV head stores at most ``budget + 1`` entries: up to
    ``budget`` tokens and the free slots the next tokens take, so that decoding copies nothing.

    Padding is not content: a row's budget or ratio counts its real tokens only, padding is never
    scored or kept in place of a real token and takes no room beyond the row that keeps the most,
    so each row of a left-padded batch decodes what its prompt decodes alone. Rows may then keep
    different numbers of tokens; the cache hands the attention modules the mask that hides each
    row's unused slots (this needs ``sdpa`` or ``eager`` attention; a batch of equal-length rows
    runs on any implementation).

    The cache is bound to ``model``, whose attention modules it observes through wrapped forwards that
    do nothing more than call the module's own when another cache (or none) is used. It works with
    fp32/fp16/bf16, grouped-query attention, beam search, assisted generation and prompt lookup
    (``crop``), and models split across devices. Positions stay logical: ``get_seq_length()`` is the
    number of tokens seen.

    Scoring with every query of a long prompt costs about twice the prompt's own attention (prefill
    takes about 1.6 times as long as with DynamicCache on a CPU, 1.7 to 2.1 times on an H100 at 8k
    to 32k tokens); ``observation_window=64`` scores with the last 64 queries only (SnapKV-style),
    cheaper and somewhat less accurate.

    Args:
        model: the (Llama-style) model the cache will serve.
        budget: tokens kept per layer, row and KV head, >= sink_tokens + recent_tokens.
        compression_ratio: fraction of the tokens to evict, in [0, 1).
        sink_tokens: first tokens always kept, >= 0.
        recent_tokens: most recent tokens always kept, >= 1.
        observation_window: how many of each forward pass's last queries score the tokens, >= 1;
            None (the default) for all of them.
        score_decay: how much of a token's earlier score carries over to the next forward pass, [0, 1].
        pool_kernel: width of a smoothing of scores over neighbouring tokens, odd, >= 1 (1: none).
        value_norm: rank tokens by score times the norm of their value vector.
        scoring: "attention" (the default: the attention tokens receive, as above) or
            "reconstruction": after the prompt's pass, replay the prompt and rank its tokens by the
            most attention any replay query pays them (query-agnostic; about one more prompt pass
            of cost; prompts without padding), or "attention+novelty": at each eviction a token ranks
            by the better of its attention rank and the rank of its key's novelty (the negative cosine
            similarity to the mean key, as KeyDiff ranks), which keeps facts nothing later refers to at
            no extra pass.
        reconstruction_chunk: prompt tokens replayed per forward pass, >= 1.
        replay_prefix: token ids fed before each replayed chunk (scoring="reconstruction"), such as an
            instruction to repeat the text (``tokenizer.encode("\\n\\nRepeat the previous context exactly.",
            add_special_tokens=False)``, as KVzip does); their queries score the prompt too. Empty by default.
        replay_overlap: each replayed chunk after the first starts with this many of the previous chunk's
            last tokens, >= 0 and smaller than reconstruction_chunk (0 by default).
        replay_scope: what a replayed chunk's attention is spread over when it scores: "prompt" (the
            default: the whole prompt, as the model attends) or "chunk" (the sink tokens, the chunk's own
            prompt tokens and the replay itself, as KVzip scores; a token is scored by its own chunk only).
        replay_output_norms: weigh each replay query's attention to an entry by the norm of what the entry
            writes into the residual stream (its value through the head's output projection) over the norm
            of the query token's hidden state, as KVzip+ does (False by default).
        replay: how reconstruction scores are had: "forward" (the prompt is fed again, as above),
            "prompt_queries" (estimated in the prompt's own pass, with no replay pass, from each prompt token's
            query placed where a replay would place it: ``replay_estimate.py``; needs allocation "heads" or
            "global", every query observed and the other replay settings at their defaults; about half the
            prefill time) or "auto" (the default): the estimate where it applies and a head keeps on average at
            least half the prompt's tokens (``ESTIMATE_FROM_SHARE``; a ratio up to 0.5, a quarter of the bytes),
            else the replay pass, which allocates small budgets better.
        scoring_backend: "auto" (the default: Triton kernels for a pass's scores when the cache is on
            CUDA and Triton is installed, else blocked PyTorch), "triton" or "torch". The kernels hold
            one tile of logits at a time (flash-attention style), so scoring a long prompt needs no
            memory beyond a float per query and per key; padded, masked, sliding-window and
            soft-capped passes use the PyTorch path.
        eviction_interval: while decoding, a row that goes over its size evicts this many tokens at
            once, >= 1: the next steps take the freed slots and evict nothing, so the per-step
            bookkeeping runs once every ``eviction_interval`` steps. Between evictions a row keeps
            from ``budget - eviction_interval + 1`` to ``budget`` tokens; the memory bound does not change
            (the waiting steps' queries are held beside it). None (the default): a 32nd of ``budget``,
            from 8 to 64, or 8 under a ratio (``default_eviction_interval``); in a cache sized in bytes, 1
            under ``allocation="heads"`` and else 8 (``byte_sized_interval``).
        kv_bits: store the kept keys and values in 16, 8, 5 or 4 bits instead of the model's dtype (None, the
            default). 16 bits: the model's dtype if it has 16 bits, else float16 (llama.cpp's f16 cache for a
            32-bit model). 8, 5 and 4 bits: each entry is coded on its own in groups of ``kv_group_size`` channels,
            with a scale and offset per group in 16 bits; keys are first turned by a Hadamard rotation, which spreads
            their outlier channels over all channels (and back when read); the last ``residual_length``
            tokens are also held exactly and attention reads them exact. Attention reads every layer's
            keys and values decoded (one layer's dense copy at a time). Without ``budget`` or
            ``compression_ratio``, every token is kept (quantization alone).
        memory_fraction: instead of a budget or ratio, hold at most this fraction, in (0, 1], of the bytes a
            full 16-bit cache would hold for the tokens seen so far (keys, values, scales and bookkeeping
            all counted, as ``memory_bytes()`` reports them), choosing how many tokens to keep from
            ``kv_bits``; without ``kv_bits``, the widths that did best at equal bytes (keys in 8 bits and
            values in 4 from 45% up, or 20% with ``allocation="global"``, else both in 4: see
            ``byte_sized_widths``). Below the sinks and the
            recent window it cannot go: on a short context the fraction is exceeded until
            ``sink_tokens + recent_tokens`` tokens fit in it.
        max_bytes: instead of a budget or ratio, hold at most this many bytes, all rows together, after
            each forward pass (the same accounting and the same floor; 4 bits unless ``kv_bits`` says).
        key_bits: the keys' width when it differs from ``kv_bits`` (16, 8, 5 or 4; ``kv_bits`` then sets the
            values'): keys suffer more from coarse codes than values do, so ``kv_bits=4, key_bits=8``
            holds nearly what 8 bits holds in about four fifths of the bytes.
        kv_group_size: channels per scale group with ``kv_bits``, a divisor of the model's head size
            (default: 32, or the head size when it is smaller).
        residual_length: with ``kv_bits`` 8, 5 or 4, how many of the last tokens are also held exact (in 16
            bits) beside their codes, as transformers' ``QuantizedCache`` keeps a residual, >= 0; None (the
            default) for ``recent_tokens``, or for none in a cache sized in bytes whose heads share the budget
            (``byte_sized_residual``). Their bytes count in ``memory_fraction`` and ``max_bytes``.
        allocation: how a row's tokens are shared among layers and KV heads: "uniform" (every layer and head
            keeps the same number), "global" (one ranking of the reconstruction scores over all layers
            decides how many each layer keeps, each at least a fifth of the even share; every KV head of a
            layer keeps that layer's number) or "heads" (one ranking over every layer and KV head, as KVzip
            allocates: each head keeps its own number, at least a fifth of the even share, and is stored
            apart with only those; attention reads a layer's heads padded to the longest, one layer at a
            time: ``decodekit/cache/heads.py``). The row's total is unchanged and the storage freed is
            real. The default is "heads" with ``scoring="reconstruction"`` (which "global" and "heads"
            need: replay scores are probabilities, the same in every layer and head) and "uniform"
            otherwise. Under both a token ranks by its reconstruction score alone, as KVzip ranks it (no
            value norm, no attention rank).
        matched_layers: how many of the model's first layers refit what they keep of the prompt when it is
            evicted (attention matching, ``decodekit/cache/matching.py``): per row and KV head, each kept entry
            gets a log-mass bias, added to its logit by every later pass, and a new value, solved so that
            attention over the kept entries reproduces attention over all of the prompt's for the prompt's own
            queries placed after it (in the first layer, exactly the queries a replay makes). Needs
            ``scoring="reconstruction"``; >= 0; None (the default): ``default_matched_layers``. Costs a fit per
            KV head at the prompt's eviction and a mask with the biases in those layers' later passes.

    Example (with ``model`` and ``batch`` from ``load_model``/``encode_prompts``)::

        from decodekit.cache import CompressedCache
        cache = CompressedCache(model, budget=512)
        output = model.generate(**batch, past_key_values=cache, max_new_tokens=256)
        print(cache.get_seq_length(), cache.kept_tokens, cache.memory_bytes())
    """

    observes_attention = True  # the attention observer feeds this cache (and only caches that say so)

    def __init__(
        self,
        model: nn.Module,
        budget: int | None = None,
        *,
        compression_ratio: float | None = None,
        sink_tokens: int = 4,
        recent_tokens: int = 32,
        observation_window: int | None = None,
        score_decay: float = 0.9,
        pool_kernel: int = 1,
        value_norm: bool = True,
        scoring: str = "attention",
        reconstruction_chunk: int = 2048,
        scoring_backend: str = "auto",
        eviction_interval: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int | None = None,
        key_bits: int | None = None,
        memory_fraction: float | None = None,
        max_bytes: int | None = None,
        allocation: str | None = None,
        replay_prefix: Sequence[int] = (),
        replay_overlap: int = 0,
        replay_scope: str = "prompt",
        replay_output_norms: bool = False,
        replay: str = "auto",
        residual_length: int | None = None,
        matched_layers: int | None = None,
    ) -> None:
        sizes = (budget, compression_ratio, memory_fraction, max_bytes)
        if all(size is None for size in sizes) and kv_bits is not None:
            compression_ratio = 0.0  # quantization alone: every token is kept
        if allocation is None:
            allocation = "heads" if scoring == "reconstruction" else "uniform"
        sized_in_bytes = memory_fraction is not None or max_bytes is not None
        if eviction_interval is None:
            eviction_interval = byte_sized_interval(allocation) if sized_in_bytes else default_eviction_interval(budget)
        head_dim = _head_dim(model)
        if sized_in_bytes and kv_bits is None and key_bits is None:
            kv_bits, key_bits = byte_sized_widths(memory_fraction, allocation, head_dim)
        if sized_in_bytes and residual_length is None:
            residual_length = byte_sized_residual(allocation, recent_tokens)
        if matched_layers is None:
            matched_layers = default_matched_layers(scoring)
        if kv_group_size is None:
            kv_group_size = min(32, head_dim) if head_dim else 32
        by_bytes = None
        if sized_in_bytes:
            by_bytes = entry_bytes(
                model,
                kv_bits=kv_bits,
                key_bits=key_bits,
                group_size=kv_group_size,
                residual_length=residual_length,  # set above: byte_sized_residual when not given
                eviction_interval=eviction_interval,
                value_norms=value_norm and allocation == "uniform",
                matched_layers=matched_layers if isinstance(matched_layers, int) else 0,  # (checked by the policy)
            )  # fmt: skip  (value norms are kept where eviction ranks by them: EvictionPolicy.ranks_by_value_norm)
        self.policy = EvictionPolicy(
            budget, compression_ratio, sink_tokens, recent_tokens, observation_window, score_decay, pool_kernel,
            value_norm, scoring, reconstruction_chunk, scoring_backend, eviction_interval, kv_bits, kv_group_size,
            key_bits, memory_fraction, max_bytes, by_bytes, allocation, replay_prefix=replay_prefix,
            replay_overlap=replay_overlap, replay_scope=replay_scope, replay_output_norms=replay_output_norms,
            replay=replay, residual_length=residual_length, matched_layers=matched_layers,
        )  # fmt: skip
        modules = bind(model, replays=self.policy.scoring == "reconstruction")
        if head_dim:  # each coded width's packing checked now (a ValueError naming kv_group_size), not mid-pass
            for bits in {kv_bits, key_bits} & set(CODED_BITS):
                Quantizer(bits, kv_group_size).groups(head_dim)
        self._layer_of_module = {id(module): index for index, module in enumerate(modules)}
        matched = [index < self.policy.matched_layers for index in range(len(modules))]
        if allocation == "heads":
            kv_heads = model.config.get_text_config().num_key_value_heads
            layers = [HeadsLayer(self.policy, kv_heads, matched=refit) for refit in matched]
        elif self.policy.scoring == "attention" and not {kv_bits, key_bits} & set(CODED_BITS) and eviction_interval > 1:
            room = SharedRoom()  # the layers evict together while decoding (``joint.py``)
            layers = room.layers = [CompressedLayer(self.policy, room, index) for index in range(len(modules))]
        else:
            layers = [CompressedLayer(self.policy, matched=refit) for refit in matched]
        super().__init__(layers=layers)
        # Coded keys are read turned, as coded, where the module's queries can be turned alike (one product per
        # query instead of one per stored key at every pass).
        keys_coded = (key_bits or kv_bits) in CODED_BITS
        for layer, module in zip(layers, modules, strict=True):
            layer.reads_turned_keys = keys_coded and queries_can_turn(module)

    @property
    def units(self) -> list[CompressedLayer]:
        """The layers that store and evict, in order: each layer, or under ``allocation="heads"`` each KV head
        of each layer."""
        return [unit for layer in self.layers for unit in getattr(layer, "units", (layer,))]

    def layer_for(self, module: nn.Module) -> CompressedLayer:
        """The cache layer that serves attention ``module``; ValueError for another model's module."""
        index = self._layer_of_module.get(id(module))
        if index is None:
            raise ValueError(
                "this CompressedCache was built for another model: create one with CompressedCache(model, ...)"
            )
        return self.layers[index]

    @property
    def awaits_replay(self) -> bool:
        """Whether the prompt has been seen and must now be replayed to score it (``scoring="reconstruction"``)."""
        first = self.units[0] if self.layers else None
        return first is not None and first.deferred and first.is_initialized and not first.replaying

    @property
    def replaying(self) -> bool:
        """Whether the prompt is being replayed now (``scoring="reconstruction"``)."""
        return bool(self.layers) and self.units[0].replaying

    def replay(self, model: nn.Module, input_ids: torch.Tensor) -> None:
        """Score the prompt by reconstruction, then evict: feed ``input_ids`` again, chunk by chunk.

        Each chunk attends to the whole prompt (and to itself) and is then forgotten. A token's
        replay score is the most attention any replay query pays it, so tokens the model needs to
        reproduce the prompt (a unique fact in repetitive text) score high even when no later
        prompt token refers to them. A token is then ranked by the better of its two ranks: by the
        attention the prompt paid it (the default scoring) and by its replay score, so that what
        either criterion values is kept (``allocation="uniform"``; the shared budgets rank by the replay alone).
        Where the policy estimates the replay (``EvictionPolicy.estimates_replay``: ``replay="prompt_queries"``,
        or ``"auto"`` at large budgets) the prompt's own pass estimated the replay's scores already
        (``replay_estimate.py``), so nothing is fed again and ``input_ids`` is not needed. Called by the model's
        forward hook after the first forward pass.
        """
        layers = self.units
        if layers[0].pad_range[1] > 0:
            raise ValueError(
                "scoring='reconstruction' needs prompts without left padding: generate one prompt at a time, "
                "or batch prompts of equal length"
            )
        length = self.get_seq_length()
        estimated = self.policy.estimates_replay(length, layers[0].rows)
        if not estimated and (input_ids is None or input_ids.shape[-1] != length):
            raise ValueError(
                "scoring='reconstruction' with a replay pass needs the first forward pass to receive the whole "
                "prompt's input_ids (or replay='prompt_queries', which does not feed the prompt again)"
            )
        # What the prompt's own queries paid, which a uniform allocation ranks by besides (the others rank by the
        # replay alone, and left the prompt's pass unscored: ``CompressedLayer.awaits_replay_alone``).
        uniform = self.policy.allocation == "uniform"
        attention = [layer.priority_scores() for layer in layers] if uniform else []
        if estimated:
            for layer in layers:
                layer.deferred = False
        else:
            self._replay_forward(model, input_ids, length)
        if not uniform:
            self._allocate()
        else:
            for layer, paid in zip(layers, attention, strict=True):
                layer.set_priority(_union_of_ranks(paid, layer.scores))
        for layer in layers:
            layer.compress(length)

    def _replay_forward(self, model: nn.Module, input_ids: torch.Tensor, length: int) -> None:
        """Feed the prompt again, chunk by chunk, each chunk forgotten after its pass; the layers keep the most
        attention any replay query paid each entry as its score."""
        layers = self.units
        for layer in layers:
            layer.replaying = True
            layer.scores = torch.zeros_like(layer.scores)
        # The replay's logits are never read: a causal LM can skip computing all but one.
        only_last_logits = {"logits_to_keep": 1} if "logits_to_keep" in signature(model.forward).parameters else {}
        try:
            with torch.no_grad():
                for piece, span in self._replay_pieces(input_ids):
                    start = span[0]
                    positions = torch.arange(length + start, length + start + piece.shape[-1], device=piece.device)
                    positions = positions.expand(piece.shape[0], -1)
                    for layer in layers:
                        layer.replay_span = span if self.policy.replay_scope == "chunk" else None
                    model(input_ids=piece, past_key_values=self, position_ids=positions, **only_last_logits)
                    self.crop(-piece.shape[-1])
                    for layer in layers:
                        layer.drop_dead()
        finally:
            for layer in layers:
                layer.replaying = layer.deferred = False
                layer.replay_span = layer.replay_weights = None

    def _replay_pieces(self, input_ids: torch.Tensor):
        """The replay's forward passes: per chunk of the prompt, the tokens fed (the replay prefix, the previous
        chunk's last ``replay_overlap`` tokens, the chunk) and the chunk's span of prompt positions."""
        policy, length = self.policy, input_ids.shape[-1]
        prefix = torch.tensor(policy.replay_prefix, dtype=input_ids.dtype, device=input_ids.device)
        prefix = prefix.expand(input_ids.shape[0], -1)
        for start in range(0, length, policy.reconstruction_chunk):
            stop = min(start + policy.reconstruction_chunk, length)
            lead = max(start - policy.replay_overlap, 0)
            yield torch.cat([prefix, input_ids[:, lead:stop]], dim=-1), (start, stop, length)

    def _allocate(self) -> None:
        """Share each row's tokens among the layers (or their KV heads, ``allocation="heads"``) by one ranking
        of their scores."""
        layers = self.units
        first = layers[0]
        real = first.seen - first.pads  # [rows]: real tokens seen
        targets = self.policy.targets(real, first.rows)
        priorities = [torch.where(layer.live, layer._priority(), -math.inf) for layer in layers]
        counts = layer_counts(priorities, targets, self.policy.allocation_floor).tolist()
        bases = targets.tolist()
        for layer, layer_count in zip(layers, counts, strict=True):
            layer.allocate(layer_count, bases)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Queries follow the stored entries physically (the attention mask is built on stored entries)."""
        return self.layers[layer_idx].slots

    def memory_bytes(self) -> int:
        """Bytes the cache holds now: every storage behind its layers' tensors, each counted once (keys,
        values, per-entry bookkeeping, reserved room and dead slots, padding, waiting steps' queries)."""
        return sum(storage_bytes(tensor for layer in self.layers for tensor in layer.held_tensors()).values())

    @property
    def kept_tokens(self) -> int:
        """The most tokens any row keeps per layer and KV head (padding never counts); under
        ``allocation="global"``, in the layer that keeps the most."""
        return max((layer.kept for layer in self.layers), default=0)
