"""Attention plus novelty: at each eviction an entry ranks by the better of its attention rank and the rank of its
key's novelty (the negative cosine similarity to its row and head's mean key, as KeyDiff ranks), which keeps facts
nothing later refers to at no extra pass."""

from __future__ import annotations

import torch
from torch.nn import functional

from decodekit.cache.eviction import rank_fractions
from decodekit.cache.scorers.attention import AttentionScorer


class NoveltyScorer(AttentionScorer):
    """Scores by attention, ranks by the better of attention and key novelty (``scoring="attention+novelty"``)."""

    def ranked_fields(self) -> None:
        """None: the importance is a rank computed from the keys as well."""
        return None

    def importance(self, layer, stop: int) -> torch.Tensor:
        """Each entry's better rank, as a fraction of its row and head's entries, under attention (``importance`` of
        ``AttentionScorer``) and under its key's novelty; ties go by the other rank, then by attention. Float64."""
        attention = super().importance(layer, stop)
        valid = layer.storage.valid(stop)
        keys = layer.decoded()[0][:, :, :stop].float()
        count = valid.sum(dim=-1, keepdim=True)
        mean = (keys * valid[..., None]).sum(dim=-2, keepdim=True) / count[..., None].clamp(min=1)
        novelty = -functional.cosine_similarity(keys, mean, dim=-1)
        by_attention, by_novelty = rank_fractions(attention, valid), rank_fractions(novelty, valid)
        better, worse = torch.maximum(by_attention, by_novelty), torch.minimum(by_attention, by_novelty)
        return better + worse * 2.0**-20 + by_attention * 2.0**-40
