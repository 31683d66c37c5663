"""Attention scoring: an entry is worth the attention it receives, averaged over the queries that see it and the
query heads that share its KV head, plus its earlier score times ``score_decay`` (H2O / SnapKV style); eviction
ranks it times the norm of its value.

A decoding step between evictions does not score at once: its queries wait, and the next eviction scores every
waiting step together, as one step at a time would have (``received.waiting_attention``).
"""

from __future__ import annotations

import torch

from decodekit.cache.received import attention_received, per_query, pooled, waiting_attention
from decodekit.cache.storage import Field
from decodekit.cache.waiting import WaitingSteps


class AttentionScorer:
    """Scores one layer's entries by the attention they receive (the default ``scoring="attention"``).

    A scorer is made per layer (``CompressedLayer``), keeps what waits to be scored, and talks to its layer through
    the layer's public methods: ``storage``, ``decoded``, ``visibility``, ``seen``.
    """

    replays = False  # whether the cache feeds the prompt again after its pass (``ReconstructionScorer``)
    flushes_together = True  # whether the layers' scorers may flush and rank together (``flush_together``)

    def __init__(self, options) -> None:
        self.options = options
        self.decay = options.scoring.score_decay
        self.waiting = WaitingSteps()
        self.waiting_from: torch.Tensor | int | None = None  # the first waiting step's slot, per segment or for all
        self.to_queries = None  # what makes queries of the waiting steps' columns

    # -- what the storage holds per entry -------------------------------------------------------------------------

    def fields(self) -> dict[str, Field]:
        """The storage fields this scorer keeps per entry: its score, and the value's norm where eviction ranks by
        it."""
        fields = {"scores": Field((), torch.float32)}
        if self.options.ranks_by_value_norm:
            fields["value_norms"] = Field((), torch.float32)
        return fields

    def new_entries(self, values: torch.Tensor) -> dict[str, torch.Tensor | float]:
        """The fields of a pass's new entries (``values`` ``[batch, heads, new, dim]``): score 0, their value norms."""
        entries: dict[str, torch.Tensor | float] = {"scores": 0.0}
        if "value_norms" in self.fields():
            entries["value_norms"] = torch.linalg.vector_norm(values, dim=-1, dtype=torch.float32)
        return entries

    # -- a pass ---------------------------------------------------------------------------------------------------

    def may_wait(self, layer, step) -> bool:
        """Whether this pass (one decoding step) may leave its scoring for the next eviction: an eviction interval
        above one, a plain layer (no window, no cap, no pooling) and room in the queue."""
        interval = self.options.size.eviction_interval
        return (
            step.new == 1 and interval > 1 and len(self.waiting) < interval and layer.window is None
            and layer.softcap is None and not layer.padding_held and self.options.scoring.pool_kernel == 1
        )  # fmt: skip

    def after_pass(self, layer, step) -> None:
        """Score the pass ``step`` (a ``layer.Pass``), or queue it (``step.waits``, as ``may_wait`` said)."""
        if step.waits:
            if not self.waiting:
                self.waiting_from = step.new_slots
            columns, cos, sin = step.columns, step.cos, step.sin
            stored = layer.coding.stored_dtype
            if stored.itemsize < columns.dtype.itemsize:  # held in the storage's 16 bits
                columns, cos, sin = columns.to(stored), cos.to(stored), sin.to(stored)
            self.waiting.add((columns, cos, sin), scaling=step.scaling)
            self.to_queries = step.to_queries
            return
        self.flush(layer)
        self.add(layer, self.received(layer, step), self.decay)

    def fused_step_decay(self, layer) -> float | None:
        """The decay by which a decoding step's scoring may run inside the step's operator (``fused_step.py``): where
        all it does is decay the scores and add the step's own attention (nothing waits, no pooling); else None."""
        return self.decay if self.options.scoring.pool_kernel == 1 and not self.waiting else None

    @staticmethod
    def add(layer, received: torch.Tensor, decay: float) -> None:
        """Decay every score of the first ``received.shape[-1]`` slots by ``decay``, then add ``received``."""
        layer.storage.decay_add("scores", received, decay)

    def received(self, layer, step) -> torch.Tensor:
        """``[batch, heads, slots]``: the mean attention each entry received from the pass's observed queries (a
        decoding step's own attention, where the layer computed it: ``layer.Pass.received``)."""
        if step.received is not None:
            return pooled(step.received / step.group, self.options.scoring.pool_kernel)
        queries = step.queries()
        visibility = layer.visibility(step)
        received = attention_received(
            queries, step.keys, step.scaling, visibility, softcap=layer.softcap, biases=layer.biases(step),
            kernels=layer.scores_on_triton,
        )  # fmt: skip
        group = queries.shape[1] // step.keys.shape[1]
        received = per_query(received, visibility.positions, layer.seen, queries.shape[2], group, layer.window)
        return pooled(received, self.options.scoring.pool_kernel)

    @torch.no_grad()
    def flush(self, layer) -> None:
        """Add the attention of the waiting decoding steps to the scores, as one step at a time would have: step
        ``t`` of ``m`` decays every score before adding its attention, so older scores are decayed ``m`` times and
        step ``t``'s attention ``m - 1 - t`` times."""
        if not self.waiting:
            return
        scaling = self.waiting.scaling
        queries = self.take_queries(layer)  # [batch, heads, steps, dim]
        steps = queries.shape[2]
        keys, _ = layer.decoded()
        first = self.waiting_from
        biases = layer.stored_biases(keys.shape[2])
        received = waiting_attention(queries, keys, first, scaling, self.decay, biases)
        self.waiting_from = None
        self.add(layer, received, self.decay**steps)
        if "value_norms" in self.fields():  # the waiting steps' own tokens: their value norms
            _, values = layer.decoded()
            slots = torch.arange(steps, device=values.device) + (first if isinstance(first, int) else first[..., None])
            norms = torch.linalg.vector_norm(values.float(), dim=-1)
            slots = slots.expand(*values.shape[:2], steps) if isinstance(first, int) else slots
            layer.storage.write_slots(slots, {"value_norms": norms.gather(-1, slots)})

    def take_queries(self, layer) -> torch.Tensor:
        """The waiting steps' queries, rotated to their positions, ``[batch, heads, steps, head_dim]``; the queue is
        emptied."""
        columns, cos, sin = (part.to(layer.dtype) for part in self.waiting.take())
        return layer.rotated_queries(self.to_queries(columns), cos, sin)

    def waiting_state(self) -> tuple[int, int] | None:
        """(steps waiting, the first one's slot in every segment), or None where segments wait from other slots."""
        if isinstance(self.waiting_from, torch.Tensor):
            return None
        return len(self.waiting), self.waiting_from

    @staticmethod
    @torch.no_grad()
    def flush_together(layers: list, grids: dict[str, torch.Tensor]) -> None:
        """``flush`` for several layers at once, whose scorers wait with the same ``waiting_state`` and whose
        storages are the stacked ``grids`` (per field ``[layers, batch, heads, capacity, ...]``, ``joint.py``): the
        queries are made per layer, their attention and the scores' update once for all."""
        scorers = [layer.scorer for layer in layers]
        first = scorers[0]
        if not first.waiting:
            return
        steps, start = first.waiting_state()
        scaling, decay = first.waiting.scaling, first.decay
        queries = _queries_together(layers)
        if queries is None:  # (each layer makes its own)
            queries = torch.stack([scorer.take_queries(layer) for layer, scorer in zip(layers, scorers, strict=True)])
        for scorer in scorers:
            scorer.waiting_from = None
        stop = start + steps
        received = waiting_attention(queries, grids["keys"][..., :stop, :], start, scaling, decay)
        grids["scores"][..., :stop].mul_(decay**steps).add_(received)
        if "value_norms" in grids:  # the waiting steps' own tokens: their value norms
            values = grids["values"][..., start:stop, :]
            grids["value_norms"][..., start:stop].copy_(torch.linalg.vector_norm(values.float(), dim=-1))

    # -- ranking --------------------------------------------------------------------------------------------------

    @classmethod
    def importance_together(cls, layers: list, grids: dict[str, torch.Tensor], stop: int) -> torch.Tensor:
        """``importance`` of several layers' entries, ``[layers, batch, heads, stop]``, from their stacked ``grids``
        (a scorer that ranks otherwise is asked layer by layer)."""
        if cls.importance is not AttentionScorer.importance:
            return torch.stack([layer.scorer.importance(layer, stop) for layer in layers])
        scores = grids["scores"][..., :stop]
        return scores * grids["value_norms"][..., :stop] if "value_norms" in grids else scores

    def ranked_fields(self) -> tuple[str, ...] | None:
        """The storage fields whose product ``importance`` is (None where it is computed otherwise), so that an
        eviction may rank entries where they lie."""
        return tuple(self.fields())

    def importance(self, layer, stop: int) -> torch.Tensor:
        """``[batch, heads, stop]``: what eviction ranks the entries by, before the sinks and the recent window are
        protected: the score, times the value's norm where the options say so."""
        scores = layer.storage.read("scores", stop)
        if "value_norms" in self.fields():
            return scores * layer.storage.read("value_norms", stop)
        return scores

    def reset(self) -> None:
        self.waiting = WaitingSteps()
        self.waiting_from = None

    def held_tensors(self) -> list[torch.Tensor]:
        """The waiting steps' queries and rotation, and each segment's first waiting slot where they differ."""
        held = self.waiting.held_tensors()
        if isinstance(self.waiting_from, torch.Tensor):
            held.append(self.waiting_from)
        return held


def _queries_together(layers: list) -> torch.Tensor | None:
    """The waiting steps' rotated queries of every layer, ``[layers, batch, heads, steps, head_dim]``, made at once
    where the layers share one query maker, one dtype and each step's rotary embedding (the same tensors: one model
    pass gave them to every layer); None elsewhere (each layer makes its own)."""
    scorers = [layer.scorer for layer in layers]
    first = scorers[0]
    dtype = layers[0].dtype
    steps = first.waiting.steps
    if any(scorer.to_queries is not first.to_queries or layer.dtype != dtype
           or len(scorer.waiting) != len(steps) for layer, scorer in zip(layers, scorers, strict=True)):  # fmt: skip
        return None
    for scorer in scorers[1:]:
        pairs = zip(scorer.waiting.steps, steps, strict=True)
        if any(own[1] is not shared[1] or own[2] is not shared[2] for own, shared in pairs):
            return None
    count = len(layers)
    columns = torch.cat([step[0] for scorer in scorers for step in scorer.waiting.steps], dim=1).to(dtype)
    cos, sin = (torch.cat([step[part] for step in steps], dim=1).to(dtype) for part in (1, 2))
    for scorer in scorers:
        scorer.waiting.clear()
    queries = first.to_queries(columns)  # [batch, heads, layers * steps, head_dim], layer by layer
    batch, heads, _, head_dim = queries.shape
    repeat = (1, count, 1)
    rotated = layers[0].rotated_queries(queries, cos.repeat(repeat), sin.repeat(repeat))
    return rotated.view(batch, heads, count, -1, head_dim).permute(2, 0, 1, 3, 4)
