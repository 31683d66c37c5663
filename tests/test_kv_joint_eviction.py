"""Eviction while decoding, alone or with the other layers (``joint.py``: layers whose storages are slices of one
tensor evict together after the last layer's pass).

Oracles: each prompt generated alone (beams and left padding); the original cache (a deep copy); a naive top-k of
the layer's own eviction ranks, taken before each eviction (the entries a decoding step keeps when the tokens of
the steps since the last eviction move into the victims' slots, with every stored field moved along); the same
cache scoring each decoding step at once instead of letting the steps wait for the next eviction (other families).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodekit.cache import CompressedCache, CompressedLayer, joint
from decodekit.cache import layer as layer_module
from decodekit.cache.scorers import attention as attention_scorer
from decodekit.cache.scorers.attention import AttentionScorer
from tests.families import VOCAB, build_family_model
from tests.tiny import build_model

PROMPT = "The class statement creates a new class object and binds it to a name. " * 6


@pytest.fixture
def fresh(tiny):
    _, tokenizer = tiny
    return build_model(tokenizer, num_layers=3), tokenizer


def _decode(model, tokenizer, cache, steps: int) -> list[int]:
    """Greedy decoding by hand after the prompt's pass."""
    ids = tokenizer([PROMPT], return_tensors="pt")["input_ids"]
    chosen = []
    with torch.no_grad():
        token = model(ids, past_key_values=cache).logits[:, -1:].argmax(dim=-1)
        for step in range(steps):
            chosen.append(int(token))
            position = torch.tensor([[ids.shape[1] + step]])
            token = model(token, past_key_values=cache, position_ids=position).logits[:, -1:].argmax(dim=-1)
    return chosen


@pytest.mark.parametrize("beams", [2, 1])
def test_generate_with_beams_and_padding_gives_each_prompt_the_text_it_gets_alone(fresh, beams):
    """Beam reorders and left padding: each row of a padded batch generates what its prompt generates alone."""
    model, tokenizer = fresh
    prompts = [PROMPT, PROMPT[:90]]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    common = {"max_new_tokens": 30, "num_beams": beams, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    cache = CompressedCache(model, budget=48)
    together = model.generate(**batch, past_key_values=cache, **common)[:, batch["input_ids"].shape[1] :]
    assert cache.get_seq_length() > 48  # it evicted
    for row, prompt in enumerate(prompts):
        single = tokenizer([prompt], return_tensors="pt")
        alone = model.generate(**single, past_key_values=CompressedCache(model, budget=48), **common)
        assert torch.equal(together[row], alone[0, single["input_ids"].shape[1] :])


@pytest.mark.parametrize("settings", [{"budget": 48}, {"budget": 48, "kv_bits": 4}, {"compression_ratio": 0.5}])
def test_a_deep_copy_taken_between_evictions_decodes_what_the_original_decodes(fresh, settings):
    """``copy.deepcopy(cache)`` (how a prompt's cache is reused for several continuations) between evictions:
    the copy keeps its reserved room and waiting steps, and both continue alike."""
    model, tokenizer = fresh
    cache = CompressedCache(model, **settings)
    _decode(model, tokenizer, cache, steps=21)  # 21 steps: past evictions, between two
    copied = copy.deepcopy(cache)
    start = cache.get_seq_length()
    continuations = []
    for each in (cache, copied):
        token, chosen = torch.tensor([[7]]), []
        with torch.no_grad():
            for step in range(20):
                position = torch.tensor([[start + step]])
                token = model(token, past_key_values=each, position_ids=position).logits[:, -1:].argmax(dim=-1)
                chosen.append(int(token))
        continuations.append((chosen, [layer.kept_positions() for layer in each.layers]))
    (mine, kept), (theirs, kept_copy) = continuations
    assert mine == theirs
    assert all(torch.equal(a, b) for a, b in zip(kept, kept_copy, strict=True))


def _state(cache: CompressedCache) -> list[dict[str, torch.Tensor]]:
    """Per layer: what each row and head holds, as attention reads it, with its positions and scores."""
    state = []
    for layer in cache.layers:
        keys, values = layer.decoded()
        state.append({"keys": keys, "values": values, "positions": layer.positions(), "scores": layer.scores()})
    return state


@pytest.mark.parametrize("family", ["qwen3", "phi3", "qwen2"])
def test_other_families_score_waiting_steps_as_each_step_at_once(monkeypatch, family):
    """Query norms (Qwen3: each layer makes its own queries), a fused query-key-value projection with partial
    rotation (Phi-3) and biased projections (Qwen2): the decoding steps that wait for the next eviction are scored
    there as scoring each step at once scores them (the oracle: the same cache whose steps never wait), so the same
    tokens are kept and generated. Their state is read after decoding outside ``no_grad``: scoring the waiting steps
    then runs a query norm's weights, which require gradients, and must still not write a graph into the scores."""
    model = build_family_model(family)
    ids = torch.randint(3, VOCAB, (1, 120), generator=torch.Generator().manual_seed(1))
    waited = []
    may_wait = AttentionScorer.may_wait

    def counted(self, layer, step):
        waits = may_wait(self, layer, step)
        waited.append(waits)
        return waits

    def decode(cache) -> list[int]:
        chosen = []
        with torch.no_grad():
            token = model(ids, past_key_values=cache).logits[:, -1:].argmax(dim=-1)
            for _ in range(40):
                chosen.append(int(token))
                token = model(token, past_key_values=cache).logits[:, -1:].argmax(dim=-1)
        return chosen

    monkeypatch.setattr(AttentionScorer, "may_wait", counted)
    waiting = CompressedCache(model, budget=48, eviction_interval=8)
    tokens = decode(waiting)
    assert sum(waited) >= 3  # steps waited
    assert any(len(layer.scorer.waiting) > 0 for layer in waiting.layers)  # and some still wait
    monkeypatch.setattr(AttentionScorer, "may_wait", lambda self, layer, step: False)
    at_once = CompressedCache(model, budget=48, eviction_interval=8)
    assert decode(at_once) == tokens
    for mine, theirs in zip(_state(waiting), _state(at_once), strict=True):
        assert not mine["scores"].requires_grad and mine["scores"].grad_fn is None
        for name in ("keys", "values", "positions"):
            assert torch.equal(mine[name], theirs[name]), name
        torch.testing.assert_close(mine["scores"], theirs["scores"])


# settings whose decoding steps evict few entries at a time: the steps' tokens move into the victims' slots
FILLS = {
    "budget": {"budget": 64, "eviction_interval": 8},
    "recent window as long as the interval": {"budget": 64, "eviction_interval": 8, "recent_tokens": 8},
    "interval past the recent window": {"budget": 64, "eviction_interval": 9, "recent_tokens": 8},
    "budget at the floor": {"budget": 36, "eviction_interval": 2},  # one unprotected entry per row goes
    "ratio": {"compression_ratio": 0.5, "eviction_interval": 8},  # a growing target: fewer go than wait
}


def _decode_ids(model, ids: torch.Tensor, cache, steps: int) -> torch.Tensor:
    """Greedy decoding by hand after the pass of ``ids`` (``[rows, length]``): ``[rows, steps]`` tokens."""
    chosen = []
    with torch.no_grad():
        token = model(ids, past_key_values=cache).logits[:, -1:].argmax(dim=-1)
        for _ in range(steps):
            chosen.append(token)
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(dim=-1)
    return torch.cat(chosen, dim=1)


def _by_position(layer) -> list[list[dict[int, dict[str, torch.Tensor]]]]:
    """Per row and KV head: each entry it holds, by position, with every stored field."""
    storage = layer.storage
    fields = {name: storage.read(name, layer.longest).clone() for name in storage.fields}
    lengths = torch.as_tensor(storage.lengths_host)
    held = []
    for row in range(storage.batch):
        heads = []
        for head in range(storage.heads):
            count = int(lengths[row, head])
            positions = fields["positions"][row, head, :count].tolist()
            assert len(set(positions)) == count  # each token once
            heads.append({position: {name: tensor[row, head, slot] for name, tensor in fields.items()}
                          for slot, position in enumerate(positions)})  # fmt: skip
        held.append(heads)
    return held


def _check_evictions(monkeypatch) -> list[str]:
    """Every eviction of a layer that holds no padding, alone (``CompressedLayer.evict_now``) or with the other layers
    (``joint._evict_together``), checked against a naive top-k of the layer's own ranks taken just before it
    (``CompressedLayer.priority``): each row and head keeps exactly its best-ranked entries, each with every stored
    field it held. Returns the record: per checked eviction, whether the steps' tokens moved into the victims' slots
    (``removal_moves``) or every entry moved, and "together" for each layer evicted with the others."""
    record = []
    evict_now, together, moves = CompressedLayer.evict_now, joint._evict_together, layer_module.removal_moves

    def counted_moves(*args, **kwargs):
        record[-1] = "filled"
        return moves(*args, **kwargs)

    def before(layer, eviction):
        layer.scorer.flush(layer)  # (the eviction scores the waiting steps first: so do the ranks)
        longest, storage = layer.longest, layer.storage
        valid = storage.valid(longest)
        priority = torch.where(valid, layer.priority(longest), -torch.inf)
        positions = torch.where(valid, storage.read("positions", longest), -1)  # (-1: an empty slot)
        return priority, positions, _by_position(layer)

    def compare(layer, eviction, taken):
        priority, positions, held = taken
        after = _by_position(layer)
        for row in range(layer.storage.batch):
            for head in range(layer.storage.heads):
                # The kept entries are a best-ranked set: as many as the eviction keeps, none ranked below an entry
                # that went (entries of equal rank, such as the zero scores of a zero value, may go either way).
                pairs = zip(positions[row, head].tolist(), priority[row, head].tolist(), strict=True)
                ranks = {position: rank for position, rank in pairs if position >= 0}
                kept = set(after[row][head])
                assert kept <= set(ranks) and len(kept) == int(eviction.keep[row, head])
                gone = set(ranks) - kept
                if gone:
                    assert min(ranks[position] for position in kept) >= max(ranks[position] for position in gone)
                for position, entry in after[row][head].items():
                    for name, value in entry.items():
                        assert torch.equal(value, held[row][head][position][name]), name

    def checked(self, eviction):
        if self.padding_held:
            return evict_now(self, eviction)
        taken = before(self, eviction)
        record.append("kept in slot order")
        evict_now(self, eviction)
        compare(self, eviction, taken)

    def checked_together(layers, eviction, flat):
        taken = [before(layer, eviction) for layer in layers]
        record.extend(["together"] * (len(layers) - 1) + ["kept in slot order"])
        together(layers, eviction, flat)
        for layer, layer_taken in zip(layers, taken, strict=True):
            compare(layer, eviction, layer_taken)

    monkeypatch.setattr(layer_module, "removal_moves", counted_moves)
    monkeypatch.setattr(joint, "removal_moves", counted_moves)
    monkeypatch.setattr(CompressedLayer, "evict_now", checked)
    monkeypatch.setattr(joint, "_evict_together", checked_together)
    return record


@pytest.fixture
def checked_evictions(monkeypatch):
    """``_check_evictions`` for one test."""
    return _check_evictions(monkeypatch)


@pytest.mark.parametrize("case", list(FILLS))
def test_the_waiting_steps_fill_the_victims_slots_and_keep_the_best_ranked_entries(fresh, checked_evictions, case):
    """Where few entries go, the tokens of the steps since the last eviction move into the victims' slots instead of
    every kept entry moving forward: each eviction keeps exactly the best-ranked entries (a naive top-k of the ranks
    taken before it), each with what it held, two rows of other tokens at once."""
    model, _ = fresh
    ids = torch.randint(3, model.config.vocab_size, (2, 120), generator=torch.Generator().manual_seed(2))
    cache = CompressedCache(model, **FILLS[case])
    _decode_ids(model, ids, cache, 40)
    assert "filled" in checked_evictions  # the fill ran
    assert "together" in checked_evictions  # the layers evicted together (``joint.py``)
    assert len(checked_evictions) >= 3 * model.config.num_hidden_layers


@st.composite
def _eviction_settings(draw) -> dict:
    """A cache's settings around the fill's boundaries: sinks and recent window, a budget from their sum (the floor)
    up or a ratio, an interval below, at and past the recent window, exact or coded storage."""
    sinks, recent = draw(st.integers(0, 6)), draw(st.integers(1, 16))
    budgets = st.integers(sinks + recent, 80).map(lambda budget: {"budget": budget})
    size = draw(st.one_of(budgets, st.sampled_from([0.3, 0.5, 0.7]).map(lambda ratio: {"compression_ratio": ratio})))
    bits = draw(st.sampled_from([None, None, 8, 4]))
    return {**size, "eviction_interval": draw(st.integers(1, 12)), "sink_tokens": sinks, "recent_tokens": recent,
            **({"kv_bits": bits} if bits else {})}  # fmt: skip


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cache_settings=_eviction_settings(), rows=st.integers(1, 2), length=st.integers(20, 120))
def test_every_eviction_keeps_the_best_ranked_entries_for_any_settings(
    fresh, monkeypatch, cache_settings, rows, length
):
    """Over drawn settings (the budget's floor, intervals past the recent window, ratios, coded storage, one or two
    rows of prompts of any length), every eviction, whether the steps' tokens fill the victims' slots or every kept
    entry moves, keeps exactly the best-ranked entries of each row and head, each with every field it held."""
    model, _ = fresh
    ids = torch.randint(3, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(length))
    with monkeypatch.context() as patch:
        record = _check_evictions(patch)
        cache = CompressedCache(model, **cache_settings)
        _decode_ids(model, ids, cache, 30)
    assert cache.get_seq_length() == length + 30
    if cache.policy.target(length + 30) < length + 30:  # (a target above every token seen never evicts)
        assert record


# Settings whose layers evict together while decoding (uniform allocation, plain entries read in place, no window).
TOGETHER = {
    "budget": ({"budget": 64}, 1),
    "every step": ({"budget": 40, "eviction_interval": 1}, 1),
    "ratio, two rows": ({"compression_ratio": 0.5}, 2),
    "novelty": ({"budget": 64, "scoring": "attention+novelty"}, 2),
    "no value norms": ({"budget": 48, "value_norm": False, "sink_tokens": 0}, 1),
}


@pytest.mark.parametrize("case", list(TOGETHER))
def test_layers_evicted_together_hold_what_each_layer_holds_evicting_alone(fresh, monkeypatch, case):
    """The oracle: the same cache whose layers evict one by one (no group). Evicting together gives the same tokens,
    and every layer holds the same entries with every field equal, in the same memory."""
    model, _ = fresh
    options, rows = TOGETHER[case]
    ids = torch.randint(3, model.config.vocab_size, (rows, 150), generator=torch.Generator().manual_seed(rows))
    together, evict_together = [], joint._evict_together

    def counted(layers, eviction, flat):
        together.append(len(layers))
        evict_together(layers, eviction, flat)

    monkeypatch.setattr(joint, "_evict_together", counted)
    made, queries_together = [], attention_scorer._queries_together  # (every layer's waiting queries at once)
    monkeypatch.setattr(attention_scorer, "_queries_together", lambda layers: made.append(queries_together(layers))
                        or made[-1])  # fmt: skip
    grouped = CompressedCache(model, **options)
    grouped_tokens = _decode_ids(model, ids, grouped, 40)
    alone = CompressedCache(model, **options)
    for layer in alone.layers:
        layer.group = None
    alone_tokens = _decode_ids(model, ids, alone, 40)
    assert together and set(together) == {model.config.num_hidden_layers}
    if options.get("eviction_interval") != 1:  # (steps that wait: the queries of every layer were made at once)
        assert made and all(queries is not None for queries in made)
    assert torch.equal(grouped_tokens, alone_tokens)
    for mine, theirs in zip(grouped.layers, alone.layers, strict=True):
        held, expected = _by_position(mine), _by_position(theirs)
        for row in range(rows):
            for head in range(mine.storage.heads):
                assert held[row][head].keys() == expected[row][head].keys()
                for position, entry in held[row][head].items():
                    for name, value in entry.items():
                        assert torch.equal(value, expected[row][head][position][name]), name
    assert grouped.memory_bytes() == alone.memory_bytes()
