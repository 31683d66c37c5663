"""One layer of the compressed cache: keys, values, and a running importance score per entry.

Entries are ``[batch, kv_heads, kept, head_dim]`` like transformers' ``DynamicLayer``; every KV
head keeps its own set of tokens (the same count for all heads and rows, so tensors stay
rectangular and every layer presents the same length to the attention mask). A batch row's left
padding stays at the front of that row, where the attention mask generate builds expects it,
and is never scored or evicted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional
from transformers.cache_utils import DynamicLayer

PROTECTED = 1.0e30
QUERY_BLOCK = (
    256  # observed queries scored at once  # the priority of sink and recent tokens: above any attention score
)


@dataclass(frozen=True)
class EvictionPolicy:
    """What a layer keeps: sinks, a recent window, and the best-scored tokens up to a budget.

    ``budget`` (a token count) or ``compression_ratio`` (keep ``1 - ratio`` of the tokens seen)
    sets the size; see :class:`~decodekit.cache.CompressedCache` for the other fields.
    """

    budget: int | None
    compression_ratio: float | None
    sink_tokens: int
    recent_tokens: int
    observation_window: int | None
    score_decay: float
    pool_kernel: int
    value_norm: bool = True

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
        self.scores: torch.Tensor | None = None  # [batch, kv_heads, kept], float32
        self.pads: torch.Tensor | None = None  # [batch], left-padding entries at the front of each row
        self.seen = 0  # tokens given to this layer: the logical length
        self._queries: tuple[torch.Tensor, float] | None = None

    # -- what the model sees ------------------------------------------------------------------------

    @property
    def kept(self) -> int:
        """The number of entries stored per row and KV head."""
        return self.keys.shape[-2] if self.is_initialized else 0

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
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.scores = key_states.new_zeros((*key_states.shape[:2], 0), dtype=torch.float32)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        new_scores = self.scores.new_zeros((*key_states.shape[:2], key_states.shape[-2]))
        self.scores = torch.cat([self.scores * self.policy.score_decay, new_scores], dim=-1)
        self.seen += key_states.shape[-2]
        queries, scaling = self._queries
        self._queries = None
        self.scores += self._attention_received(queries, scaling)
        return self.keys, self.values

    # -- scoring and eviction -------------------------------------------------------------------------

    def _attention_received(self, queries: torch.Tensor, scaling: float) -> torch.Tensor:
        """Mean attention each entry gets from the observed queries (the last ones) that can see it.

        Computed per KV head (averaged over the query heads that share it) in blocks of queries, each
        against only the keys it can see, so memory stays at ``QUERY_BLOCK x kept`` per head.
        """
        batch, kv_heads, length, head_dim = self.keys.shape
        window = queries.shape[2]
        grouped = queries.float().reshape(batch, kv_heads, -1, window, head_dim)
        keys = self.keys.float()
        pads = self.pads.to(keys.device)[:, None, None, None, None]
        first = length - window  # the physical index of the first observed query
        received = keys.new_zeros((batch, kv_heads, length))
        for start in range(0, window, QUERY_BLOCK):
            stop = min(start + QUERY_BLOCK, window)
            visible_keys = first + stop
            logits = torch.einsum("bhgwd,bhtd->bhgwt", grouped[:, :, :, start:stop], keys[:, :, :visible_keys])
            key_index = torch.arange(visible_keys, device=keys.device)
            query_index = torch.arange(first + start, first + stop, device=keys.device)
            hidden = (key_index > query_index[:, None]) | (key_index < pads)
            probs = (logits * scaling).masked_fill(hidden, float("-inf")).softmax(dim=-1)
            received[..., :visible_keys] += probs.sum(dim=(2, 3))
        key_index = torch.arange(length, device=keys.device)
        seen_by = (length - key_index).clamp(max=window) * grouped.shape[2]  # how many observed queries see a key
        received = received / seen_by
        kernel = self.policy.pool_kernel
        if kernel > 1:
            flat = received.reshape(batch * kv_heads, 1, length)
            received = functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
            received = received.reshape(batch, kv_heads, length)
        return received

    def compress(self) -> None:
        """Evict down to the policy's target: pads, sinks and recent tokens first, then the best scored."""
        length = self.kept
        target = self.policy.target(self.seen)
        if length <= target:
            return
        position = torch.arange(length, device=self.keys.device)
        pads = self.pads.to(self.keys.device)[:, None]
        is_pad = position[None, :] < pads
        is_sink = ~is_pad & (position[None, :] < pads + self.policy.sink_tokens)
        is_recent = position[None, :] >= length - self.policy.recent_tokens
        priority = self.scores * self.values.float().norm(dim=-1) if self.policy.value_norm else self.scores
        priority = torch.where((is_sink | is_recent)[:, None, :], PROTECTED, priority)
        priority = torch.where(is_pad[:, None, :], float("inf"), priority)
        keep = priority.topk(target, dim=-1, sorted=False).indices.sort(dim=-1).values
        expanded = keep[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, expanded)
        self.values = self.values.gather(2, expanded)
        self.scores = self.scores.gather(2, keep)

    # -- batch bookkeeping (beam search) ------------------------------------------------------------

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            super().reorder_cache(beam_idx)
            self.scores = self.scores.index_select(0, beam_idx.to(self.scores.device))
            self.pads = self.pads.index_select(0, beam_idx.to(self.pads.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            super().batch_repeat_interleave(repeats)
            self.scores = self.scores.repeat_interleave(repeats, dim=0)
            self.pads = self.pads.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            super().batch_select_indices(indices)
            self.scores = self.scores[indices]
            self.pads = self.pads[indices]

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a CompressedCache cannot be cropped: its entries are no longer a contiguous prefix")

    def reset(self) -> None:
        super().reset()
        self.scores = self.pads = self._queries = None
        self.seen = 0

    def memory_bytes(self) -> int:
        """Bytes held by this layer's tensors (keys, values and scores)."""
        if not self.is_initialized:
            return 0
        return sum(tensor.numel() * tensor.element_size() for tensor in (self.keys, self.values, self.scores))
