"""A coded layer's decoding step as one C++ operator on a CPU (``torch.ops.decodekit.decode_step``).

A decoding step of a layer whose codes the C++ operators read (``_native.py``) runs four of them: the step's key and
value coded into their slots, the attention over the codes, the scores decayed and added to, and an eviction of one
entry a segment; around each the host decides (the eviction's targets, kept counts and lengths) and dispatches. On a
small model the host's part is most of a step. Where a layer evicts at most one entry a segment at a step (a
byte-sized cache does), the next steps' evictions can be decided at once: ``FusedSteps`` plans which segments drop an
entry at each of the next ``STEPS_PLANNED`` steps, from the targets the policy gives at each step's count of tokens
seen (what ``CompressedLayer.eviction_due`` decides step by step), and runs each step as one operator that does the
four. Its results are theirs, byte for byte.

Example (what ``CompressedLayer`` does at its decoding steps)::

    fused = FusedSteps.plan(layer)               # None where a step does more than the four operators
    if fused is not None and fused.holds(layer):  # (at each step, until the plan ends or the storage changes)
        rows, read_keys = layer.coding.step_rows(keys)  # (the layer counts the step's token)
        output = fused.step(layer, query, scaling, rows, read_keys, values, {})
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from decodekit.cache.eviction import PROTECTED

STEPS_PLANNED = 32  # decoding steps whose evictions one plan decides

CompressedLayer = Any  # a decodekit.cache.layer.CompressedLayer (not imported: that module imports this one)


class FusedSteps:
    """The plan of a layer's next decoding steps, each run as one operator.

    ``drops[k]`` says which segments evict an entry after step ``k`` (0 or 1, ``[batch, heads]``) and ``after[k]``
    the least and most lengths and the fewest free slots after it; the plan holds while the layer's storage, shares
    and lengths are the ones it was made for (``holds``). Made by ``plan``, None where a step does more than the four
    operators.
    """

    def __init__(
        self, layer: CompressedLayer, drops: np.ndarray, after: list[tuple[tuple[int, int], int]]
    ) -> None:
        storage = layer.storage
        coding = layer.coding
        self.first_seen = layer.seen
        self.version = storage.version
        self.count = len(drops)
        self.after = after  # after each step: the least and most lengths, and the fewest free slots
        self.drops = torch.from_numpy(np.ascontiguousarray(drops, dtype=np.int64)).unbind()  # per step [batch, heads]
        self.shares = layer.shares
        flat = storage.flat
        self.fields = list(flat.values())
        self.coded = [flat[name] for name in ("keys", "key_scales", "key_offsets", "values", "value_scales",
                                              "value_offsets")]  # fmt: skip
        self.bits = [coding.quantizers["keys"].bits, coding.quantizers["values"].bits]
        self.group_size = layer.options.storage.group_size
        self.storage = storage
        self.capacities = torch.from_numpy(storage.capacities)
        self.zeroed = [flat[name] for name in ("scores", "biases") if name in flat]  # (a new entry's score is 0)
        ranked = layer.scorer.ranked_fields()
        self.value_norms = flat[ranked[1]] if len(ranked) > 1 else None
        self.decay = layer.scorer.fused_step_decay(layer)
        size = layer.options.size
        self.sink_tokens, self.recent_tokens = size.sink_tokens, size.recent_tokens
        self.key_means, self.residual = coding.read_key_means(), coding.residual_window()

    @classmethod
    def plan(cls, layer: CompressedLayer, steps: int | None = None) -> FusedSteps | None:
        """The plan of ``layer``'s next ``steps`` (``STEPS_PLANNED``) decoding steps (fewer where a step would need
        a segment to grow or to drop more than one entry), or None where not even the next one can run fused.

        At an eviction interval of one a step keeps ``min(length + 1, target)`` entries a segment
        (``EvictionPolicy.kept_counts``), so after step ``k`` a segment holds ``k + min(L + 1, min over j <= k of
        (T_j - j))``, ``L`` its length now and ``T_j`` its target at step ``j``: one cumulative minimum plans them
        all."""
        steps = STEPS_PLANNED if steps is None else steps
        if steps < 1 or not applies(layer):
            return None
        storage = layer.storage
        targets = layer.targets_ahead(steps)  # [steps, batch, heads]: each step's targets, once its token is seen
        now = storage.lengths_host
        ahead = np.arange(steps)[:, None, None]
        kept = ahead + np.minimum(now + 1, np.minimum.accumulate(targets - ahead, axis=0))  # after each step
        before = np.concatenate([now[None], kept[:-1]])
        drops = before + 1 - kept
        fits = ((before + 1 <= storage.capacities) & (drops >= 0) & (drops <= 1)).all(axis=(1, 2))
        count = steps if fits.all() else int(fits.argmin())
        if count == 0:
            return None
        kept = kept[:count]
        after = zip(zip(kept.min(axis=(1, 2)).tolist(), kept.max(axis=(1, 2)).tolist(), strict=True),
                    (storage.capacities - kept).min(axis=(1, 2)).tolist(), strict=True)  # fmt: skip
        return cls(layer, drops[:count], list(after))

    def holds(self, layer: CompressedLayer) -> bool:
        """Whether the plan covers ``layer``'s coming step: the step it planned next, with the storage, shares and
        lengths it planned (the storage's ``version`` counted up by its own steps alone)."""
        index = layer.seen - self.first_seen
        storage = self.storage
        return 0 <= index < self.count and layer.storage is storage and storage.version == self.version + index \
            and layer.shares is self.shares  # fmt: skip

    def step(
        self, layer: CompressedLayer, query: torch.Tensor, scaling: float, rows: torch.Tensor,
        read_keys: torch.Tensor, values: torch.Tensor, others: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Run the coming step (the layer counted its token already: ``layer.seen`` includes it): ``rows`` are its
        keys as coded (float32 ``[batch, heads, 1, head_dim]``), ``read_keys`` and ``values`` as attention reads them,
        ``others`` the fields of its entry that are written (its value's norm), its score zeroed. A residual window
        holds the step's token already. Returns the attention output ``[batch, 1, heads, head_dim]`` in the query's
        dtype."""
        storage = self.storage
        seen = layer.seen
        index = seen - 1 - self.first_seen
        drops = self.drops[index]
        flat, fields = storage.flat, storage.fields
        written, written_values = [], []
        for name, value in others.items():
            written.append(flat[name])
            written_values.append(value.to(fields[name].dtype).contiguous())
        output = torch.ops.decodekit.decode_step(
            self.fields, self.coded, [_float32(rows), _float32(values)], self.bits, self.group_size,
            flat["positions"], seen - 1, written, written_values, self.zeroed, storage.starts, storage.lengths,
            self.capacities, _float32(query), _float32(read_keys), _float32(values), scaling, self.key_means,
            flat["scores"], self.decay, self.value_norms, drops, seen, self.sink_tokens, self.recent_tokens,
            PROTECTED, *(self.residual or (None, None, None)),
        )  # fmt: skip
        storage.lengths_set_in_place(*self.after[index])  # (the operator counted them as planned)
        return output if query.dtype == torch.float32 else output.to(query.dtype)


def applies(layer: CompressedLayer) -> bool:
    """Whether ``layer``'s decoding steps are the four operators alone: coded keys and values in groups of one size
    read by the C++ operators (a residual window written first), no biases, sliding window, logit cap or held
    padding, a scorer that adds each step's attention to decayed scores and ranks by its fields
    (``fused_step_decay``), an eviction of one entry a segment ranked by the scores where they lie."""
    storage = layer.storage
    coding = layer.coding
    if storage is None or not coding.quantized or not coding.appends_steps_natively(storage):
        return False
    return (
        not layer.transient and not layer.waits_for_prompt_scores and not layer.biased and layer.window is None
        and layer.softcap is None and not layer.padding_held and not layer.pads.any() and layer.prompt_queries is None
        and layer.scorer.fused_step_decay(layer) is not None and layer.natively_ranked() is not None
        and layer.interval == 1
    )  # fmt: skip


def _float32(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor if tensor.dtype == torch.float32 else tensor.float()).contiguous()
