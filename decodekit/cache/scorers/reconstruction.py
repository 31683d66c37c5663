"""Reconstruction scoring (KVzip, Kim et al. 2025): after the prompt's pass the cache feeds the prompt again, in
chunks that attend to the whole prompt and are then forgotten, and ranks each prompt token by the most attention
any replayed query pays it. A fact that nothing later in the prompt refers to (a pass key in filler) survives.

Where a head keeps much of the prompt the replay is estimated in the prompt's own pass instead
(``replay_estimate.py``). The scores are probabilities, the same in every layer and head, so one ranking can share
the size among layers or heads (``allocation.py``). On a model with sliding-window layers every layer keeps its even
share by default (``options.default_allocation``); each windowed layer ranks its prompt by the better of an entry's
replay rank and its rank by the attention the prompt's own queries paid it, and each global layer by that attention
alone: the continuation needs the prompt's latest tokens, which replay scores spread thin there
(``prompt_ranks``; ``benchmarks/results/kv_gemma3_protocol_cpu.txt``). Decoding steps are then scored as
``AttentionScorer`` scores them.
"""

from __future__ import annotations

from inspect import signature

import torch
from torch import nn

from decodekit.cache.allocation import ALLOCATIONS
from decodekit.cache.eviction import rank_fractions
from decodekit.cache.received import attention_received
from decodekit.cache.replay_estimate import replay_scores
from decodekit.cache.scorers.attention import AttentionScorer
from decodekit.settings import ESTIMATE_FROM_SHARE


class ReconstructionScorer(AttentionScorer):
    """Scores a layer's prompt by reconstruction (``scoring="reconstruction"``), its later tokens by attention."""

    replays = True

    def __init__(self, options) -> None:
        super().__init__(options)
        self.replaying = False
        self.replay_span: tuple[int, int, int] | None = None  # (start, stop, the piece's end): replay_scope="chunk"
        # Under replay_output_norms, the coming replay pass's 1 / hidden-state norm per query [batch, tokens] and each
        # query head's output-projection Gram matrix [heads, head_dim, head_dim].
        self.replay_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        # Where the layer's share is kept by rank under both scores (``joins_attention``): the attention the prompt's
        # queries paid each entry, [batch, heads, slots], until the prompt's eviction.
        self.prompt_attention: torch.Tensor | None = None
        # Under a uniform allocation where the replay is estimated: the prompt's estimated replay scores, [batch,
        # heads, slots], until the prompt's eviction ranks with them (``prompt_ranks``).
        self.estimated: torch.Tensor | None = None

    @staticmethod
    def after_prompt(cache, model: nn.Module, input_ids: torch.Tensor | None) -> None:
        """After the prompt's pass: score it by reconstruction, share the size, evict (``replay_prompt``)."""
        replay_prompt(cache, model, input_ids)

    def weigh_replay(self, inverse_hidden_norms: torch.Tensor, output_grams: torch.Tensor) -> None:
        """Weights for the coming replay pass (``replay_output_norms``): ``[batch, tokens]``, one over each query's
        hidden-state norm, and ``[heads, head_dim, head_dim]``, each query head's output projection ``W`` as
        ``W^T W``."""
        self.replay_weights = (inverse_hidden_norms, output_grams)

    @property
    def ranks_by_replay_alone(self) -> bool:
        """Whether the prompt ranks by its replay scores alone (a shared allocation, as KVzip ranks); a uniform
        allocation ranks by the better of the prompt's own attention rank and its replay rank."""
        return self.options.size.allocation != "uniform"

    def after_pass(self, layer, step) -> None:
        if self.replaying:
            self.score_replay(layer, step)
            return
        estimates = layer.waits_for_prompt_scores and step.first and \
            estimates_replay(self.options, layer.policy, layer.seen, layer.rows)  # fmt: skip
        if layer.waits_for_prompt_scores and self.ranks_by_replay_alone:
            if self.joins_attention(layer):
                self.prompt_attention = self.received(layer, step)
            if estimates:
                layer.storage.write_prefix("scores", self._estimate(layer, step))
            return  # the replay's scores replace anything this pass's queries would give
        if estimates and self.needs_replay_scores(layer):  # (a uniform allocation: ranked with the attention)
            self.estimated = self._estimate(layer, step)
        super().after_pass(layer, step)

    def fused_step_decay(self, layer) -> float | None:
        """As the attention scorer's, outside a replay and the prompt's wait for its scores."""
        if self.replaying or layer.waits_for_prompt_scores:
            return None
        return super().fused_step_decay(layer)

    def needs_replay_scores(self, layer) -> bool:
        """Whether ``layer``'s prompt ranking reads replay scores: everywhere but, under a uniform allocation on a
        model with sliding-window layers, the global layers, which rank by the prompt's attention alone
        (``prompt_ranks``)."""
        return self.ranks_by_replay_alone or not self.is_global_beside_windows(layer)

    def is_global_beside_windows(self, layer) -> bool:
        """Whether ``layer`` is a global layer of a model with sliding-window layers."""
        return self.options.sliding_windows and layer.window is None

    def prompt_ranks(self, layer, attention: torch.Tensor, replay: torch.Tensor | None) -> torch.Tensor:
        """Under a uniform allocation, what a layer's prompt entries are ranked by (on the scale of ``attention``,
        the prompt's own attention ``[batch, heads, slots]``): the better of their attention and replay ranks
        (``union_of_ranks``), or the attention alone where no replay scores are read (``needs_replay_scores``). On
        Gemma 3's tuning texts with 90% of the tokens evicted (a replay pass in one chunk), the global layers ranked
        by attention alone gave +28.51% against +36.56% ranked by both, and the windowed layers ranked by both
        +36.56% against +40.02% by attention alone (``benchmarks/results/kv_gemma3_protocol_cpu.txt``)."""
        if replay is None or not self.needs_replay_scores(layer):
            return attention
        return union_of_ranks(attention, replay, layer.storage.valid(attention.shape[-1]))

    def joins_attention(self, layer) -> bool:
        """Whether ``layer`` keeps its share of a shared allocation (``allocation`` "heads" or "layers" given) by the
        better of its replay and attention ranks: a global layer of a model with sliding-window layers."""
        return self.is_global_beside_windows(layer)

    def rank_with_attention(self, layer) -> None:
        """After the size is shared: where the prompt's attention was kept (``joins_attention``), rank the layer's
        entries by the better of their replay and attention ranks (``union_of_ranks``)."""
        paid, self.prompt_attention = self.prompt_attention, None
        if paid is None:
            return
        stop = layer.longest
        union = union_of_ranks(paid[..., :stop], layer.storage.read("scores", stop), layer.storage.valid(stop))
        layer.storage.write_prefix("scores", union)

    def take_estimate(self) -> torch.Tensor | None:
        """The prompt's estimated replay scores held for its ranking (None where none are); no longer held."""
        estimated, self.estimated = self.estimated, None
        return estimated

    def reset(self) -> None:
        super().reset()
        self.prompt_attention = self.estimated = None

    def held_tensors(self) -> list[torch.Tensor]:
        """The waiting steps' queries, and the prompt's attention or estimated replay scores until the prompt's
        eviction."""
        held = super().held_tensors()
        return held + [part for part in (self.prompt_attention, self.estimated) if part is not None]

    def score_replay(self, layer, step) -> None:
        """A replayed chunk: each entry keeps the most attention any of its queries pays it."""
        queries = step.queries()
        weights = None
        if self.replay_weights is not None:
            weights = _output_weights(self.replay_weights, step.values, queries.shape[2], queries.shape[1])
        received = attention_received(
            queries, step.keys, step.scaling, layer.visibility(step), softcap=layer.softcap,
            biases=layer.biases(step), most=True, weights=weights, outside=self._outside_span(layer, step),
        )  # fmt: skip
        stop = received.shape[-1]
        scores = layer.storage.read("scores", stop)
        torch.maximum(scores, received, out=scores)
        if not layer.storage.reads_views(stop):
            layer.storage.write_prefix("scores", scores)

    def _outside_span(self, layer, step) -> torch.Tensor | None:
        """``[batch, heads, 1, 1, slots]``: the prompt entries a replayed chunk does not score under
        ``replay_scope="chunk"`` (all but the sinks and the chunk's own span); None under the prompt scope."""
        if self.replay_span is None:
            return None
        start, stop, length = self.replay_span
        positions = layer.storage.read("positions", step.keys.shape[2])
        prompt = (positions >= self.options.size.sink_tokens) & (positions < length)
        return (prompt & ((positions < start) | (positions >= stop)))[:, :, None, None, :]

    @torch.no_grad()
    def _estimate(self, layer, step) -> torch.Tensor:
        """The prompt's replay scores estimated from its own pass (``replay_estimate.replay_scores``), ``[batch,
        heads, tokens]``."""
        queries = step.queries()
        keys = step.keys
        if queries.shape[2] != keys.shape[2]:
            raise ValueError("replay='prompt_queries' needs the prompt's first pass to observe every query")
        if queries.shape[2] < 2:  # one token: nothing a replay could rank
            return keys.new_zeros(keys.shape[:3], dtype=torch.float32)
        return replay_scores(
            queries, keys, step.scaling, step.cos, step.sin, chunk=estimate_chunk(self.options, keys.shape[2]),
            rotated=layer.coding.rotated_reads, sliding_window=layer.window, softcap=layer.softcap,
            kernels=layer.scores_on_triton,
        )  # fmt: skip


def estimates_replay(options, policy, length: int, rows: int = 1) -> bool:
    """Whether a prompt of ``length`` tokens in each of ``rows`` rows is scored by the estimate instead of a replay
    pass: always under ``replay="prompt_queries"``, never under ``"forward"``; under ``"auto"`` where the estimate
    applies and, on a model with sliding-window layers, always (a replay pass feeds each chunk after the first with
    no window of context: nothing before it in the replay, the prompt out of reach), else where the heads keep on
    average at least ``ESTIMATE_FROM_SHARE`` of the prompt."""
    mode = options.replay.mode
    if mode != "auto":
        return mode == "prompt_queries"
    if options.estimate_applies:
        return False
    return options.sliding_windows or policy.target(length, rows) >= ESTIMATE_FROM_SHARE * length


def estimate_chunk(options, length: int) -> int:
    """The replay chunk an estimate of a ``length``-token prompt stands for: ``reconstruction_chunk``, or on a model
    with sliding-window layers the whole prompt (each replayed token sees every earlier one, as the prompt's own
    queries did).

    Example:
        >>> from dataclasses import replace
        >>> from decodekit.cache.options import ReplayOptions, ResolvedOptions, ScoringOptions, SizeOptions
        >>> from decodekit.cache.options import StorageOptions
        >>> plain = ResolvedOptions(SizeOptions(budget=64), ScoringOptions(), StorageOptions(), ReplayOptions())
        >>> estimate_chunk(plain, 3072), estimate_chunk(replace(plain, sliding_windows=True), 3072)
        (2048, 3072)
    """
    return max(options.replay.chunk, length) if options.sliding_windows else options.replay.chunk


def _output_weights(replay_weights, values: torch.Tensor, window: int, heads: int):
    """KVzip+'s weights for a replay pass: ``[batch, window]``, one over each query's hidden-state norm, and
    ``[batch, kv_heads, group, 1, slots]``, the norm of what each entry writes through each query head's output
    projection."""
    inverse_hidden_norms, grams = replay_weights
    kv_heads, head_dim = values.shape[1], values.shape[-1]
    group = heads // kv_heads
    grams = grams.to(torch.float32).view(kv_heads, group, head_dim, head_dim)
    flat = values.float()
    squared = torch.einsum("bksd,kgde,bkse->bkgs", flat, grams, flat).clamp_(min=0)
    return inverse_hidden_norms[:, -window:].float(), squared.sqrt_()[:, :, :, None, :]


def union_of_ranks(attention: torch.Tensor, replay: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per row and head, each entry's better rank under two scores, on the scale of ``attention`` so that the
    attention later queries add keeps its weight."""
    better = torch.maximum(rank_fractions(attention, valid), rank_fractions(replay, valid)).to(attention.dtype)
    count = valid.sum(dim=-1, keepdim=True).clamp(min=1)
    mean = (attention * valid).sum(dim=-1, keepdim=True) / count
    better_mean = (better * valid).sum(dim=-1, keepdim=True) / count
    return better * mean / better_mean.clamp(min=1e-30)


def replay_prompt(cache, model: nn.Module, input_ids: torch.Tensor | None) -> None:
    """Score a piece of context by reconstruction, share the size among layers or heads, then evict: called after
    each forward pass of several tokens that reads the context (the prompt in one pass, or each chunk of it, as
    generate's ``prefill_chunk_size`` reads it; until the first decoding step or ``end_context``). The piece's
    tokens are fed again; the entries held from earlier pieces keep their scores and take the most attention the
    new replay pays them too, so that a prompt read in chunks never holds more than its size and one chunk. Where
    the replay of a first pass is estimated, that pass scored it already and nothing is fed again."""
    layers = cache.layers
    first = layers[0]
    if bool(first.pads.any()):
        raise ValueError(
            "scoring='reconstruction' needs prompts without left padding: generate one prompt at a time, "
            "or batch prompts of equal length"
        )
    start = first.context_start
    length = first.seen - start  # the piece's tokens
    options = cache.options
    estimated = start == 0 and estimates_replay(options, first.policy, length, first.rows)
    if not estimated and (input_ids is None or input_ids.shape[-1] != length):
        raise ValueError(
            "scoring='reconstruction' with a replay pass needs each forward pass of several tokens to receive its "
            "input_ids (or replay='prompt_queries', which does not feed the prompt again)"
        )
    uniform = options.size.allocation == "uniform"
    attention = [layer.scorer.importance(layer, layer.longest) for layer in layers] if uniform else []
    if not estimated:
        _replay_forward(cache, model, input_ids, start)
    if uniform:
        for layer, paid in zip(layers, attention, strict=True):
            replay = layer.scorer.take_estimate() if estimated else layer.storage.read("scores", layer.longest)
            ranks = layer.scorer.prompt_ranks(layer, paid, replay)
            if "value_norms" in layer.storage.fields:
                ranks = ranks / layer.storage.read("value_norms", layer.longest).clamp(min=1e-30)
            layer.storage.write_prefix("scores", ranks)
    else:
        ALLOCATIONS[options.size.allocation](layers)
        for layer in layers:
            layer.scorer.rank_with_attention(layer)
    for layer in layers:
        layer.waits_for_prompt_scores = False
        layer.evict(length)
        layer.prompt_queries = None  # (a refit applies to the prompt's own eviction: none came, none will)
        layer.fit_capacity()


def _replay_forward(cache, model: nn.Module, input_ids: torch.Tensor, start: int) -> None:
    """Feed a piece of context (``input_ids``, the tokens from position ``start`` on) again, chunk by chunk, each
    chunk forgotten after its pass; each of the piece's entries keeps the most attention any replayed query paid it,
    and each entry held from earlier pieces the most of its score and that."""
    layers = cache.layers
    replay = cache.options.replay
    length = layers[0].seen
    for layer in layers:
        layer.scorer.replaying = layer.transient = True
        stop = layer.longest
        earlier = layer.storage.read("positions", stop) < start
        layer.storage.write_prefix("scores", torch.where(earlier, layer.storage.read("scores", stop), 0.0))
    only_last_logits = {"logits_to_keep": 1} if "logits_to_keep" in signature(model.forward).parameters else {}
    try:
        with torch.no_grad():
            for piece, span in _pieces(input_ids, replay, start):
                placed = length + span[0] - start  # (each replayed chunk placed after every token seen)
                positions = torch.arange(placed, placed + piece.shape[-1], device=piece.device)
                for layer in layers:
                    layer.scorer.replay_span = span if replay.scope == "chunk" else None
                model(input_ids=piece, past_key_values=cache, position_ids=positions.expand(piece.shape[0], -1),
                      **only_last_logits)  # fmt: skip
                for layer in layers:
                    layer.forget_last(piece.shape[-1])
    finally:
        for layer in layers:
            layer.scorer.replaying = layer.transient = False
            layer.scorer.replay_span = layer.scorer.replay_weights = None


def _pieces(input_ids: torch.Tensor, replay, offset: int = 0):
    """The replay's forward passes: per chunk of a piece of context whose first token is at position ``offset``,
    the tokens fed (the replay prefix, the previous chunk's last ``overlap`` tokens, the chunk) and the chunk's span
    of positions, ``(start, stop, the piece's end)``."""
    length = input_ids.shape[-1]
    prefix = torch.tensor(replay.prefix, dtype=input_ids.dtype, device=input_ids.device)
    prefix = prefix.expand(input_ids.shape[0], -1)
    for start in range(0, length, replay.chunk):
        stop = min(start + replay.chunk, length)
        lead = max(start - replay.overlap, 0)
        yield torch.cat([prefix, input_ids[:, lead:stop]], dim=-1), (offset + start, offset + stop, offset + length)
