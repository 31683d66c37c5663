"""One layer of the compressed cache: keys, values, and a running importance score per entry.

Entries are ``[batch, kv_heads, slots, head_dim]`` like transformers' ``DynamicLayer``; every KV
head keeps its own set of tokens (the same count for all heads and rows, so tensors stay
rectangular and every layer presents the same length to the attention mask). Each entry records
its logical position, so entries need not stay in order: when one token arrives and one must go,
the newcomer takes the evicted entry's slot and nothing is copied. A batch row's left padding
stays at the front of that row, where the attention mask generate builds expects it, and is
never scored or evicted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional
from transformers.cache_utils import DynamicLayer

from decodekit._validation import check_int


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


PROTECTED = 1.0e30  # the priority of sink and recent tokens: above any attention score
QUERY_BLOCK = 256  # observed queries scored at once


@dataclass(frozen=True)
class EvictionPolicy:
    """What a layer keeps: sinks, a recent window, and the best-scored tokens up to a budget.

    ``budget`` (a token count) or ``compression_ratio`` (keep ``1 - ratio`` of the tokens seen)
    sets the size; see :class:`~decodekit.cache.CompressedCache` for the other fields. Every
    field is checked on construction, with a ValueError that names it.

    Example:
        >>> EvictionPolicy(budget=64).target(seen=1000)
        64
        >>> EvictionPolicy(budget=8)
        Traceback (most recent call last):
        ...
        ValueError: budget must be an integer >= 36 (sink_tokens + recent_tokens = 4 + 32); got 8
    """

    budget: int | None = None
    compression_ratio: float | None = None
    sink_tokens: int = 4
    recent_tokens: int = 32
    observation_window: int | None = None
    score_decay: float = 0.9
    pool_kernel: int = 1
    value_norm: bool = True

    def __post_init__(self) -> None:
        check_int("sink_tokens", self.sink_tokens, 0)
        check_int("recent_tokens", self.recent_tokens, 1)
        if self.observation_window is not None:
            check_int("observation_window", self.observation_window, 1, " or None (every query)")
        check_int("pool_kernel", self.pool_kernel, 1)
        if self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be odd; got {self.pool_kernel}")
        if not _is_number(self.score_decay) or not 0 <= self.score_decay <= 1:
            raise ValueError(f"score_decay must be in [0, 1]; got {self.score_decay!r}")
        if (self.budget is None) == (self.compression_ratio is None):
            raise ValueError("give exactly one of budget (tokens kept) and compression_ratio (fraction evicted)")
        if self.budget is not None:
            protected = f" (sink_tokens + recent_tokens = {self.sink_tokens} + {self.recent_tokens})"
            check_int("budget", self.budget, self.sink_tokens + self.recent_tokens, protected)
        elif not _is_number(self.compression_ratio) or not 0 <= self.compression_ratio < 1:
            raise ValueError(f"compression_ratio must be in [0, 1); got {self.compression_ratio!r}")

    def target(self, seen: int) -> int:
        """How many entries a layer that has seen ``seen`` tokens keeps."""
        if self.budget is not None:
            return self.budget
        kept = math.ceil((1.0 - self.compression_ratio) * seen)
        return max(kept, self.sink_tokens + self.recent_tokens)


class CompressedLayer(DynamicLayer):
    """A ``DynamicLayer`` that scores its entries by the attention they receive and evicts the least useful."""

    is_croppable = False

    def __init__(self, policy: EvictionPolicy) -> None:
        super().__init__()
        self.policy = policy
        self.seen = 0  # tokens given to this layer: the logical length
        self.pads: torch.Tensor | None = None  # [batch], left-padding entries at the front of each row
        # Per entry, [batch, kv_heads, slots]: score, value norm, logical position.
        self.scores: torch.Tensor | None = None
        self.value_norms: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.free: torch.Tensor | None = None  # [batch, kv_heads]: the slot evicted last, for the next token
        self._queries: tuple[torch.Tensor, float] | None = None

    # -- what the model sees ------------------------------------------------------------------------

    @property
    def kept(self) -> int:
        """The number of tokens stored per row and KV head (a free slot does not count)."""
        if not self.is_initialized:
            return 0
        return self.keys.shape[-2] - (self.free is not None)

    def get_seq_length(self) -> int:
        """The logical length (all tokens seen), from which models derive positions."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kept + query_length, 0

    def observe(self, queries: torch.Tensor, scaling: float, pads: torch.Tensor | None) -> None:
        """Receive the rotated queries of the coming forward pass's last tokens, before ``update``."""
        if self.pads is None:
            self.pads = pads if pads is not None else torch.zeros(queries.shape[0], dtype=torch.long)
            self.pads = self.pads.to(queries.device)
        self._queries = (queries, scaling)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._queries is None:
            raise ValueError(
                "this CompressedCache was not built for the model it is used with: "
                "create it with CompressedCache(model, ...) for that model"
            )
        batch, kv_heads, new, _ = key_states.shape
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            empty = key_states.new_zeros((batch, kv_heads, 0), dtype=torch.float32)
            self.scores, self.value_norms = empty, empty.clone()
            self.positions = empty.to(torch.int32)
        positions = torch.arange(self.seen, self.seen + new, device=key_states.device, dtype=torch.int32)
        positions = positions.expand(batch, kv_heads, new)
        value_norms = value_states.float().norm(dim=-1)
        self.scores = self.scores * self.policy.score_decay
        if self.free is not None and new == 1:
            self._fill_free_slot(key_states, value_states, value_norms, positions)
        else:
            if self.free is not None:
                self._drop_free_slot()
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.scores = torch.cat([self.scores, self.scores.new_zeros((batch, kv_heads, new))], dim=-1)
            self.value_norms = torch.cat([self.value_norms, value_norms], dim=-1)
            self.positions = torch.cat([self.positions, positions], dim=-1)
        self.seen += new
        queries, scaling = self._queries
        self._queries = None
        self.scores += self._attention_received(queries, scaling)
        return self.keys, self.values

    def _fill_free_slot(self, key_states, value_states, value_norms, positions) -> None:
        slot = self.free[..., None]
        expanded = slot[..., None].expand(-1, -1, -1, key_states.shape[-1])
        self.keys.scatter_(2, expanded, key_states)
        self.values.scatter_(2, expanded, value_states)
        self.scores.scatter_(2, slot, 0.0)
        self.value_norms.scatter_(2, slot, value_norms)
        self.positions.scatter_(2, slot, positions)
        self.free = None

    def _drop_free_slot(self) -> None:
        slots = self.keys.shape[-2]
        index = torch.arange(slots - 1, device=self.keys.device).expand(*self.free.shape, slots - 1)
        self._keep(index + (index >= self.free[..., None]))
        self.free = None

    def _keep(self, index: torch.Tensor) -> None:
        """Keep the entries at ``index`` ([batch, kv_heads, n] slots), in that order."""
        expanded = index[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, expanded)
        self.values = self.values.gather(2, expanded)
        self.scores = self.scores.gather(2, index)
        self.value_norms = self.value_norms.gather(2, index)
        self.positions = self.positions.gather(2, index)

    def kept_positions(self) -> torch.Tensor:
        """The logical positions of the stored tokens, ``[batch, kv_heads, kept]``, in increasing order."""
        positions = self.positions
        if self.free is not None:
            slot = torch.arange(positions.shape[-1], device=positions.device)
            positions = positions.masked_fill(slot == self.free[..., None], torch.iinfo(positions.dtype).max)
            positions = positions.sort(dim=-1).values[..., :-1]
        return positions.sort(dim=-1).values

    # -- scoring and eviction -------------------------------------------------------------------------

    def _attention_received(self, queries: torch.Tensor, scaling: float) -> torch.Tensor:
        """Mean attention each entry gets from the observed queries (the last ones) that can see it.

        Computed per KV head (averaged over the query heads that share it) in blocks of queries.
        The new tokens sit after every older entry, so a block needs only the slots before its
        last query; visibility within them follows logical positions.
        """
        batch, kv_heads, slots, head_dim = self.keys.shape
        window = queries.shape[2]
        grouped = queries.float().reshape(batch, kv_heads, -1, window, head_dim)
        keys = self.keys.float()
        positions = self.positions[:, :, None, None, :]
        pads = self.pads.to(keys.device)[:, None, None, None, None]
        first_slot, first_position = slots - window, self.seen - window
        received = keys.new_zeros((batch, kv_heads, slots))
        for start in range(0, window, QUERY_BLOCK):
            stop = min(start + QUERY_BLOCK, window)
            visible_slots = first_slot + stop if window > 1 else slots
            logits = torch.einsum("bhgwd,bhtd->bhgwt", grouped[:, :, :, start:stop], keys[:, :, :visible_slots])
            query_position = torch.arange(first_position + start, first_position + stop, device=keys.device)
            entry_position = positions[..., :visible_slots]
            hidden = (entry_position > query_position[:, None]) | (entry_position < pads)
            probs = (logits * scaling).masked_fill(hidden, float("-inf")).softmax(dim=-1)
            received[..., :visible_slots] += probs.sum(dim=(2, 3))
        # How many observed queries see each entry: entries among the new tokens are seen by fewer.
        seen_by = (self.seen - self.positions).clamp(min=1, max=window) * grouped.shape[2]
        received = received / seen_by
        kernel = self.policy.pool_kernel
        if kernel > 1:
            flat = received.reshape(batch * kv_heads, 1, slots)
            received = functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
            received = received.reshape(batch, kv_heads, slots)
        return received

    def compress(self) -> None:
        """Evict down to the policy's target: pads, sinks and recent tokens first, then the best ranked."""
        slots = self.keys.shape[-2]
        target = self.policy.target(self.seen)
        if slots <= target:
            return
        pads = self.pads.to(self.keys.device)[:, None, None]
        is_pad = self.positions < pads
        protected = (self.positions < pads + self.policy.sink_tokens) | (
            self.positions >= self.seen - self.policy.recent_tokens
        )
        priority = self.scores * self.value_norms if self.policy.value_norm else self.scores
        priority = torch.where(protected, PROTECTED, priority)
        priority = torch.where(is_pad, float("inf"), priority)
        if slots - target == 1:
            self.free = priority.argmin(dim=-1)  # the next token takes this slot; nothing is copied
        else:
            self._keep(priority.topk(target, dim=-1, sorted=False).indices.sort(dim=-1).values)

    # -- batch bookkeeping (beam search) ------------------------------------------------------------

    def _per_row(self) -> tuple[str, ...]:
        return ("keys", "values", "scores", "value_norms", "positions", "pads", "free")

    def _apply_to_rows(self, operation) -> None:
        for name in self._per_row():
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, operation(tensor))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._apply_to_rows(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._apply_to_rows(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._apply_to_rows(lambda tensor: tensor[indices.to(tensor.device)])

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a CompressedCache cannot be cropped: it no longer holds a contiguous prefix")

    def reset(self) -> None:
        super().reset()
        self.scores = self.value_norms = self.positions = self.pads = self.free = self._queries = None
        self.seen = 0

    def memory_bytes(self) -> int:
        """Bytes held by this layer's tensors (keys, values and the per-entry bookkeeping)."""
        if not self.is_initialized:
            return 0
        tensors = (self.keys, self.values, self.scores, self.value_norms, self.positions)
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)
