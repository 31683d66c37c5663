"""How a compressed cache layer scores its entries: the attention each receives from the observed queries
(exactly, in blocks, or with the Triton kernels on CUDA), decoding steps scored in a batch at the next
eviction, and the priority eviction ranks by (sinks and recent tokens protected, value norms,
novelty).

``EntryScoring`` is a mixin of ``CompressedLayer``; the attributes it works on are set up in
``CompressedLayer.__init__``.
"""

from __future__ import annotations

import math
import os
from functools import cache, lru_cache
from types import ModuleType

import torch
from torch.nn import functional

from decodekit.cache.replay_estimate import replay_scores
from decodekit.cache.rotary import rotate
from decodekit.cache.storage import positions_from

PROTECTED = 1.0e30  # the priority of sink and recent tokens: above any attention score
QUERY_BLOCK = 128  # observed queries scored at once
LOGIT_ELEMENTS = 1 << 25  # at most this many logits (128 MiB in float32) held at once while scoring
# Waiting steps scored on a CPU: at most this many logits at once (1 MiB in float32), so that each block's logits,
# probabilities and weighted sums stay in the processor's cache (an eviction of 64 waiting steps of 16 layers over
# 2,049 entries held 67 MB of logits at once and took 84-88 ms).
CPU_WAITING_LOGIT_ELEMENTS = 1 << 18


@cache
def _triton_scoring() -> ModuleType | None:
    """The Triton scoring kernels, or None where Triton is not installed."""
    try:
        import decodekit.cache._triton_scoring as kernels
    except ImportError:
        return None
    return kernels


def rank_fractions(values: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
    """Per row and head, each entry's rank by ``values`` among the live entries (all when ``live`` is None),
    as a float64 fraction in [0, 1); dead entries get negative fractions. Ties go by slot order.

    Example:
        >>> rank_fractions(torch.tensor([[[0.3, 0.1, 0.2, 0.0]]]), torch.tensor([[[True, True, True, False]]]))
        tensor([[[ 0.6667,  0.0000,  0.3333, -0.3333]]], dtype=torch.float64)
    """
    if live is None:
        order = values.argsort(dim=-1, stable=True).argsort(dim=-1)
        return order.double() / values.shape[-1]
    count = live.sum(dim=-1, keepdim=True)
    order = torch.where(live, values.double(), -math.inf).argsort(dim=-1, stable=True).argsort(dim=-1)
    return (order - (live.shape[-1] - count)).double() / count.clamp(min=1)


@lru_cache(maxsize=64)
def _step_tensors(steps: int, group: int, decay: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For scoring ``steps`` waiting decoding steps at once (``CompressedLayer._score_pending``): ``[steps, steps]``,
    True where step t may not see step u's token (u > t), and ``[1, group * steps]``, the weight of step t's attention
    (``decay ** (steps - 1 - t)``) over the ``group`` query heads that share a KV head, for each query head and step
    in that order. Built once per shape and device (read only)."""
    later = torch.ones(steps, steps, dtype=torch.bool, device=device).triu_(1)
    exponents = torch.arange(steps - 1, -1, -1, dtype=torch.float64, device=device)
    return later, (decay**exponents / group).to(torch.float32).repeat(group)[None, :]


def waiting_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    first: int,
    scaling: float,
    decay: float,
    biases: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention that ``steps`` waiting decoding steps paid, as one step at a time would have added it:
    ``[..., kv_heads, first + steps]``, from their rotated queries ``[..., heads, steps, head_dim]`` and the
    stored keys ``[..., kv_heads, slots, head_dim]``, where step ``t``'s token is in slot ``first + t`` and saw
    the slots before its own and itself; step ``t``'s attention is decayed ``steps - 1 - t`` times and
    averaged over the query heads that share a KV head. Any leading dimensions (rows; layers) are kept.
    ``biases``: each entry's log-mass bias, ``[..., kv_heads, slots]``, added to its logits (refit entries).

    Example:
        >>> queries, keys = torch.zeros(1, 2, 2, 4), torch.zeros(1, 1, 3, 4)  # 2 query heads, 1 KV head
        >>> waiting_attention(queries, keys, first=1, scaling=1.0, decay=0.5)  # step 0 sees 2 slots, step 1 all 3
        tensor([[[0.5833, 0.5833, 0.3333]]])
    """
    *lead, heads, steps, head_dim = queries.shape
    kv_heads, visible = keys.shape[-3], first + steps
    group = heads // kv_heads
    # One unit per leading index and KV head: its group's queries at every step, and its keys.
    grouped = queries.to(keys.dtype).reshape(-1, group * steps, head_dim)
    # (flattened before the visible slots are taken: a view of a contiguous room, where the slice first would copy)
    keys = keys.reshape(-1, *keys.shape[-2:])[:, :visible]
    biases = None if biases is None else biases.reshape(-1, biases.shape[-1])[:, :visible]
    # (a compiled step makes them in its graph: dynamo traces through the cache, and warns that it does)
    step_tensors = _step_tensors.__wrapped__ if torch.compiler.is_compiling() else _step_tensors
    later, weights = step_tensors(steps, group, decay, keys.device)
    limit = CPU_WAITING_LOGIT_ELEMENTS if keys.device.type == "cpu" else LOGIT_ELEMENTS
    units, block = grouped.shape[0], max(limit // (group * steps * visible), 1)
    parts = [
        _weighted_attention(grouped[start : start + block], keys[start : start + block], first, scaling, later,
                            weights, None if biases is None else biases[start : start + block])
        for start in range(0, units, block)
    ]  # fmt: skip
    received = parts[0] if len(parts) == 1 else torch.cat(parts)
    return received.view(*lead, kv_heads, visible)


def _weighted_attention(grouped, keys, first, scaling, later, weights, biases) -> torch.Tensor:
    """``waiting_attention`` for units of queries ``[n, group * steps, head_dim]`` over keys ``[n, visible,
    head_dim]``: ``[n, visible]``."""
    steps = later.shape[0]
    logits = torch.matmul(grouped, keys.transpose(-1, -2)).float().mul_(scaling)
    if biases is not None:
        logits += biases[:, None, :].float()
    stepwise = logits.view(logits.shape[0], -1, steps, logits.shape[-1])  # [n, group, steps, visible]
    stepwise[..., first:].masked_fill_(later, -math.inf)  # step t sees the steps' tokens up to its own
    # Each step's probabilities, weighted, summed over query heads and steps.
    return torch.matmul(weights, logits.softmax(dim=-1)).squeeze(-2)


def best_in_slot_order(priority: torch.Tensor, keep: int) -> torch.Tensor:
    """The slots of the ``keep`` highest priorities along the last dimension, in slot order (``[..., keep]``).

    It finds the few that go (a top-k of the lowest) and packs the others forward with a running count:
    on a CPU, a top-k of nearly every entry followed by a sort costs several times more.

    Example:
        >>> best_in_slot_order(torch.tensor([[0.5, 0.1, 0.9, 0.3, 0.7]]), keep=3)
        tensor([[0, 2, 4]])
    """
    slots = priority.shape[-1]
    going = priority.topk(slots - keep, dim=-1, largest=False).indices
    stays = torch.ones_like(priority, dtype=torch.bool).scatter_(-1, going, False)
    target = torch.where(stays, stays.cumsum(dim=-1) - 1, keep)  # a kept slot's place; the others go to a spare one
    order = torch.arange(slots, device=priority.device).expand_as(target)
    packed = priority.new_empty((*priority.shape[:-1], keep + 1), dtype=torch.long)
    return packed.scatter_(-1, target, order)[..., :keep]


def protect(
    scores: torch.Tensor,
    positions: torch.Tensor,
    seen: int | torch.Tensor,
    sink_tokens: int,
    recent_tokens: int,
    pads=0,
) -> torch.Tensor:
    """``scores`` with the sink tokens (the first ``sink_tokens`` after a row's ``pads``) and the recent ones
    (the last ``recent_tokens`` of the ``seen``) raised above every score; any leading dimensions.

    Example:
        >>> protect(torch.tensor([0.5, 0.1, 0.2, 0.3]), torch.arange(4), seen=4, sink_tokens=1, recent_tokens=1)
        tensor([1.0000e+30, 1.0000e-01, 2.0000e-01, 1.0000e+30])
    """
    protected = (positions < pads + sink_tokens) | (positions >= seen - recent_tokens)
    return torch.where(protected, PROTECTED, scores)


class EntryScoring:
    """The importance of a ``CompressedLayer``'s entries, and the order in which eviction takes them."""

    def _rotated_queries(self, columns: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The observed tokens' queries, ``[batch, heads, tokens, head_dim]``, rotated to their positions."""
        return rotate(self._to_queries(columns), cos.unsqueeze(1), sin.unsqueeze(1))

    def _wait_for_scoring(self, columns: torch.Tensor, scaling: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Queue a decoding step's observed query columns and rotation until the next eviction scores them: in
        the storage's 16 bits when keys and values are stored narrower than the model's dtype."""
        held = self.storage_dtype
        if held is not None and held.itemsize < columns.dtype.itemsize:
            columns, cos, sin = columns.to(held), cos.to(held), sin.to(held)
        self._pending.add((columns, cos, sin), scaling=scaling, room=self.policy.eviction_interval)

    def _defers_scoring(self, new: int, free: torch.Tensor | None) -> bool:
        """Whether this pass's scoring waits for the next eviction: one decoding step appended to the spare room
        while ``_may_defer_scoring``. Anything else first scores the waiting steps."""
        deferred = new == 1 and free is None and self._may_defer_scoring()
        if not deferred:
            self._score_pending()
        return deferred

    def _may_defer_scoring(self) -> bool:
        """Whether a decoding step appended to the spare room may leave its scoring for the next eviction: the
        layer's queries see every entry (no padding, no window, no cap, no pooling, no dead slot), it is not
        replaying, and fewer than ``eviction_interval`` steps wait (a row under its target evicts nothing); never
        when evicting at every step (its room serves a growing target only)."""
        return (
            self.policy.eviction_interval > 1 and self._spare is not None and self.pad_range[1] == 0
            and self.sliding_window is None
            and self.softcap is None and self.policy.pool_kernel == 1 and not self.replaying
            and self.live_range[0] == self.keys.shape[-2] and len(self._pending) < self.policy.eviction_interval
        )  # fmt: skip

    def _score_pending(self) -> None:
        """Add the attention of the waiting decoding steps to the scores, as one step at a time would (read before
        every use of the scores: with no step waiting, it only brings the bookkeeping views up to date).

        Step ``t`` of ``m`` (its token in slot ``first + t``) saw the slots before its own and itself;
        a step decays every score by ``score_decay`` before adding its attention, so older scores are
        decayed ``m`` times and step ``t``'s attention ``m - 1 - t`` times. Entries appended during the
        steps start from 0.
        """
        self._catch_up()
        if self._pending:
            self._score_waiting()

    @torch.no_grad()  # bookkeeping: read at any time, never part of a graph (a query norm's weight is)
    def _score_waiting(self) -> None:
        """``_score_pending``'s work, when steps wait."""
        first, scaling = self.slots - len(self._pending), self._pending.scaling  # the waiting tokens: the last slots
        columns, cos, sin = (part.to(self.dtype) for part in self._pending.take())
        queries = self._rotated_queries(columns, cos, sin)  # [batch, heads, steps, head_dim]
        steps, decay = queries.shape[2], self.policy.score_decay
        keys, values = self.dense()
        visible = first + steps
        biases = self._biases if self.biased else None
        received = waiting_attention(queries, keys, first, scaling, decay, biases)
        self._scores[:, :, :visible].mul_(decay**steps).add_(received)
        if self._value_norms is not None:
            self._value_norms[:, :, first:visible] = values[:, :, first:visible].float().norm(dim=-1)

    @torch.no_grad()
    def _replay_estimate(self, stored, keys: torch.Tensor) -> torch.Tensor:
        """The prompt's replay scores estimated from its own pass (``replay="prompt_queries"``,
        ``replay_estimate.replay_scores``): ``stored`` is the first pass's ``StoredPass``, ``keys`` all its entries."""
        queries = self._rotated_queries(stored.columns, stored.cos, stored.sin)
        if queries.shape[2] != keys.shape[2]:
            raise ValueError("replay='prompt_queries' needs the prompt's first pass to observe every query")
        if queries.shape[2] < 2:  # one token: nothing a replay could rank
            return keys.new_zeros(keys.shape[:3], dtype=torch.float32)
        return replay_scores(
            queries, keys, stored.scaling, stored.cos, stored.sin, chunk=self.policy.reconstruction_chunk,
            turned=self.reads_turned_keys, sliding_window=self.sliding_window,
            softcap=self.softcap, kernels=self._on_triton(),
        )  # fmt: skip

    @torch.no_grad()
    def _attention_received(
        self, queries: torch.Tensor, scaling: float, keys: torch.Tensor, values: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mean attention each entry gets from the observed queries (the last ones) that can see it.

        Computed per KV head (averaged over the query heads that share it) in blocks of queries,
        exactly (a softmax per query over every entry it sees), without materializing more than
        one block of logits. When the new tokens were appended, a block needs only the slots
        before its last query. With no padding, no dead entry and no sliding window, only the
        block's own diagonal needs a causal mask; otherwise visibility follows logical positions
        and liveness. Left-padding queries (first pass only) see padding only, so they give real
        entries nothing. ``keys`` are the stored keys as attention reads them (``dense``).
        """
        batch, kv_heads, slots, head_dim = keys.shape
        window, group = queries.shape[2], queries.shape[1] // kv_heads
        appended = window > 1  # a pass of several tokens is appended; one token may fill a free slot
        unmasked = self.pad_range[1] == 0 and self.live_range[0] == slots and self.sliding_window is None
        if window == 1 and unmasked and not self.replaying and self.softcap is None and self.policy.pool_kernel == 1:
            # One decoding step that sees every entry: logits in the cache's dtype, as eager attention
            # computes them, then a float32 softmax per query head, averaged over the group.
            grouped = queries.to(keys.dtype).reshape(batch, kv_heads, group, head_dim)
            logits = torch.matmul(grouped, keys.transpose(-1, -2)).float().mul_(scaling)  # [batch, kv_heads, group, -]
            if self.biased:
                logits += self.biases[:, :, None, :].float()
            return logits.softmax(dim=-1).mean(dim=2)
        causal_only = appended and unmasked
        biases = self.biases.float() if self.biased else None
        if causal_only and self.softcap is None and not self.replaying and biases is None and self._on_triton():
            received = _triton_scoring().attention_received(queries.to(keys.dtype), keys, scaling)
            return self._per_query(received, window, group)
        grouped = (queries.float() * scaling).reshape(batch, kv_heads, group, window, head_dim)
        keys_t = keys.float().transpose(-1, -2)[:, :, None]  # [batch, kv_heads, 1, head_dim, slots]
        first_slot, first_position = slots - window, self._seen_now() - window
        received = grouped.new_zeros((batch, kv_heads, slots))
        outside = self._outside_replay_span() if self.replaying else None
        query_weights = output_norms = None
        if self.replaying and self.replay_weights is not None:
            query_weights, output_norms = self._replay_weights(values, window, group)
        block = max(1, min(QUERY_BLOCK, LOGIT_ELEMENTS // (batch * kv_heads * group * slots)))
        for start in range(0, window, block):
            stop = min(start + block, window)
            visible = first_slot + stop if appended else slots
            logits = torch.matmul(grouped[:, :, :, start:stop], keys_t[..., :visible])  # [b, h, g, w, t]
            if self.softcap is not None:
                logits.div_(self.softcap).tanh_().mul_(self.softcap)
            if biases is not None:
                logits += biases[:, :, None, None, :visible]
            if causal_only:
                diagonal = logits[..., first_slot + start : visible]
                diagonal += torch.full(diagonal.shape[-2:], -math.inf, device=logits.device).triu_(1)
            else:
                logits.masked_fill_(self._hidden(first_position + start, stop - start, visible), -math.inf)
            if outside is not None:
                logits.masked_fill_(outside[..., :visible], -math.inf)
            logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
            # Normalize each query's row and sum over the queries in one product: (1 / row sums) @ exp.
            if self.replaying:  # the most attention any replay query pays each entry
                logits.div_(logits.sum(dim=-1, keepdim=True))
                if query_weights is not None:
                    logits.mul_(query_weights[:, None, None, start:stop, None]).mul_(output_norms[..., :visible])
                received[..., :visible] = torch.maximum(received[..., :visible], logits.amax(dim=(2, 3)))
                continue
            inverse = logits.sum(dim=-1).reciprocal_().reshape(batch, kv_heads, 1, -1)
            rows = logits.reshape(batch, kv_heads, -1, visible)
            received[..., :visible] += torch.matmul(inverse, rows).squeeze(2)
        if self.replaying:
            return received
        return self._per_query(received, window, group)

    def _per_query(self, received: torch.Tensor, window: int, group: int) -> torch.Tensor:
        """Attention summed over the observed queries and a KV head's group, as a mean per query that sees
        each entry, smoothed over neighbours when the policy says so."""
        batch, kv_heads, slots = received.shape
        # How many observed queries see each entry: entries among the new tokens are seen by fewer,
        # and under a sliding window so are entries that leave it.
        seen = last_seer = self._seen_now()
        if self.sliding_window is not None:
            last_seer = (self.positions + self.sliding_window).clamp(max=seen)
        seen_by = (last_seer - self.positions.clamp(min=seen - window)).clamp(min=1) * group
        received = received / seen_by
        kernel = self.policy.pool_kernel
        if kernel > 1:
            flat = received.reshape(batch * kv_heads, 1, slots)
            received = functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
            received = received.reshape(batch, kv_heads, slots)
        return received

    def _on_triton(self) -> bool:
        """Whether this layer's scores run on the Triton kernels (see ``scoring_backend``)."""
        backend = self.policy.scoring_backend
        if backend == "torch":
            return False
        if backend == "auto":
            return self.keys.is_cuda and _triton_scoring() is not None
        if _triton_scoring() is None:
            raise ValueError("scoring_backend='triton' needs the triton package (pip install triton)")
        if not self.keys.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"scoring_backend='triton' needs the cache on a CUDA device; it is on {self.keys.device}: "
                "use scoring_backend='auto' or 'torch'"
            )
        return True

    def _replay_weights(self, values: torch.Tensor, window: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KVzip+'s weights for this replay pass: ``[batch, window]``, one over each query's hidden-state norm,
        and ``[batch, kv_heads, group, 1, slots]``, the norm of what each entry writes through each query head's
        output projection."""
        inverse_hidden_norms, grams = self.replay_weights
        kv_heads, head_dim = values.shape[1], values.shape[-1]
        grams = grams.to(torch.float32).view(kv_heads, group, head_dim, head_dim)
        flat = values.float()
        squared = torch.einsum("bksd,kgde,bkse->bkgs", flat, grams, flat).clamp_(min=0)
        return inverse_hidden_norms[:, -window:].float(), squared.sqrt_()[:, :, :, None, :]

    def _outside_replay_span(self) -> torch.Tensor | None:
        """``[batch, kv_heads, 1, 1, slots]``: True for the prompt's entries a replayed chunk does not score under
        ``replay_scope="chunk"`` (all but the sinks and the chunk's own span); None under the prompt scope."""
        if self.replay_span is None:
            return None
        start, stop, length = self.replay_span
        positions = self.positions
        prompt = (positions >= self.policy.sink_tokens) & (positions < length)
        return (prompt & ((positions < start) | (positions >= stop)))[:, :, None, None, :]

    def _hidden(self, first_query: int | torch.Tensor, queries: int, visible: int) -> torch.Tensor:
        """``[batch, kv_heads, 1, queries, visible]``: True where one of ``queries`` queries at consecutive positions
        from ``first_query`` may not see an entry among the first ``visible`` slots."""
        query_position = positions_from(first_query, queries, self.positions.device)[:, None]
        entry_position = self.positions[:, :, None, None, :visible]
        dead = ~self.live[:, :, None, None, :visible]
        hidden = (entry_position > query_position) | (dead & (query_position >= self.pads[:, None, None, None, None]))
        if self.sliding_window is not None:
            hidden |= query_position - entry_position >= self.sliding_window
        return hidden

    def priority_scores(self) -> torch.Tensor:
        """The entries' scores as eviction ranks them: times the value norm when the policy says so
        (``EvictionPolicy.ranks_by_value_norm``)."""
        return self.scores * self.value_norms if self.policy.ranks_by_value_norm else self.scores

    def set_priority(self, priority: torch.Tensor) -> None:
        """Store scores such that ``priority_scores()`` returns ``priority``."""
        self.scores = priority / self.value_norms.clamp(min=1e-30) if self.policy.ranks_by_value_norm else priority

    def _priority(self) -> torch.Tensor:
        """Sinks and recent tokens above every score, then score (times value norm); under a sliding
        window, tokens no later query can see go first."""
        pads = self.pads[:, None, None] if self.pad_range[1] else 0
        scores = self.priority_scores()
        if self.policy.scoring == "attention+novelty":
            scores = self._with_novelty(scores)
        policy = self.policy
        seen = self._seen_now()
        priority = protect(scores, self.positions, seen, policy.sink_tokens, policy.recent_tokens, pads)
        if self.sliding_window is not None:
            priority = torch.where(self.positions <= seen - self.sliding_window, -PROTECTED, priority)
        return priority

    def _with_novelty(self, attention: torch.Tensor) -> torch.Tensor:
        """Each live entry's better rank, as a fraction of the live entries, under ``attention`` and under the
        novelty of its key (negative cosine similarity to the row and head's mean live key, as KeyDiff
        ranks); ties go by the other rank, then by attention. Float64; dead entries rank lowest."""
        live = self.live
        count = live.sum(dim=-1, keepdim=True)
        keys = self.dense()[0].float()
        mean = (keys * live[..., None]).sum(dim=-2, keepdim=True) / count[..., None].clamp(min=1)
        novelty = -functional.cosine_similarity(keys, mean, dim=-1)
        by_attention, by_novelty = rank_fractions(attention, live), rank_fractions(novelty, live)
        better, worse = torch.maximum(by_attention, by_novelty), torch.minimum(by_attention, by_novelty)
        return better + worse * 2.0**-20 + by_attention * 2.0**-40
