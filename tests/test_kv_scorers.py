"""The scorer seam: a scorer is its class and one registry row; the three that ship are there."""

from __future__ import annotations

import pytest
import torch

from decodekit.cache import CompressedCache
from decodekit.cache.scorers import SCORERS
from decodekit.cache.scorers.attention import AttentionScorer
from decodekit.settings import KV_SCORERS, KV_SCORINGS
from tests.decode_steps import prompt_batch
from tests.tiny import build_model


class NewestScorer(AttentionScorer):
    """A scorer written outside the package: every entry is worth its position (the newest are kept, StreamingLLM's
    rule), scored as the attention scorer scores (its waiting steps, its fields) but ranked by recency alone."""

    def importance(self, layer, stop: int) -> torch.Tensor:
        return layer.storage.read("positions", stop).float()


def test_the_registry_names_each_scorer_file_and_the_settings_list_them():
    assert tuple(SCORERS) == KV_SCORINGS == tuple(KV_SCORERS)
    for name, path in KV_SCORERS.items():
        module, class_name = path.split(":")
        assert SCORERS[name].__module__ == module and SCORERS[name].__name__ == class_name


def test_a_new_scorer_is_its_class_and_one_registry_row(tiny, monkeypatch):
    """Oracle: StreamingLLM's rule by hand, the sinks and the newest tokens up to the budget, in every layer and row;
    the cache takes the new name through its options like the scorers that ship, and refuses it unregistered."""
    _, tokenizer = tiny
    model = build_model(tokenizer)
    monkeypatch.setitem(SCORERS, "newest", NewestScorer)
    cache = CompressedCache(model, budget=48, scoring="newest", sink_tokens=4, recent_tokens=8)
    batch = prompt_batch(tokenizer)
    length = batch["input_ids"].shape[1]
    with torch.no_grad():
        model(**batch, past_key_values=cache)
    expected = [*range(4), *range(length - 44, length)]
    for layer in cache.layers:
        assert isinstance(layer.scorer, NewestScorer)
        assert all(heads == expected for row in layer.kept_positions().tolist() for heads in row)
    monkeypatch.delitem(SCORERS, "newest")
    with pytest.raises(ValueError, match="scoring must be one of 'attention', 'reconstruction', 'attention\\+novelty'"):
        CompressedCache(model, budget=48, scoring="newest")
