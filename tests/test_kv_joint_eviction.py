"""Layers that evict together (``decodekit/cache/joint.py``) keep exactly what each layer keeps when it
evicts alone; the oracle is the same cache with the joint eviction switched off."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodekit.cache import CompressedCache, joint
from tests.families import VOCAB, build_family_model
from tests.tiny import build_model

PROMPT = "The class statement creates a new class object and binds it to a name. " * 6


@pytest.fixture
def fresh(tiny):
    _, tokenizer = tiny
    return build_model(tokenizer, num_layers=3), tokenizer


@pytest.fixture
def counted(monkeypatch):
    """Counts the joint evictions; ``counted.off()`` makes every layer evict alone from then on."""

    class Counter:
        calls = 0

        @staticmethod
        def off() -> None:
            monkeypatch.setattr(joint.SharedRoom, "_together", lambda self, layers: None)

    real = joint.evict_together

    def counting(*args, **kwargs):
        Counter.calls += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(joint, "evict_together", counting)
    return Counter


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


def _state(cache: CompressedCache) -> list[dict[str, torch.Tensor]]:
    return [
        {"keys": layer.keys, "values": layer.values, "positions": layer.positions, "live": layer.live,
         "scores": layer.scores, "value_norms": layer.value_norms}
        for layer in cache.layers
    ]  # fmt: skip


@pytest.mark.parametrize(
    "settings",
    [
        {"budget": 64, "eviction_interval": 8},
        {"budget": 36, "eviction_interval": 2},  # the floor
        {"budget": 48, "eviction_interval": 5, "value_norm": False, "score_decay": 0.5},
        {"compression_ratio": 0.5, "eviction_interval": 8},  # a target that grows: the room is made anew
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_evicting_together_keep_what_each_keeps_alone(fresh, counted, settings, dtype):
    model, tokenizer = fresh
    model = model.to(dtype)
    together = CompressedCache(model, **settings)
    tokens = _decode(model, tokenizer, together, steps=40)
    assert counted.calls >= 3  # the mechanism ran
    counted.off()
    calls = counted.calls
    alone = CompressedCache(model, **settings)
    assert _decode(model, tokenizer, alone, steps=40) == tokens
    assert counted.calls == calls
    for mine, theirs in zip(_state(together), _state(alone), strict=True):
        for name in ("keys", "values", "positions", "live"):
            assert torch.equal(mine[name], theirs[name]), name
        torch.testing.assert_close(mine["scores"], theirs["scores"])
        torch.testing.assert_close(mine["value_norms"], theirs["value_norms"])
    assert together.memory_bytes() == alone.memory_bytes()


def test_generate_with_beams_and_padding_gives_the_same_text_together_or_alone(fresh, counted):
    """Beam reorders and left padding take the layers out of the shared room (each evicts alone), one prompt
    alone stays in it: the texts are those of layers that always evict alone."""
    model, tokenizer = fresh
    batch = tokenizer([PROMPT, PROMPT[:90]], return_tensors="pt", padding=True, padding_side="left")
    single = tokenizer([PROMPT], return_tensors="pt")
    runs = []
    for switch in (None, counted.off):
        if switch is not None:
            switch()
        outputs = []
        for inputs, beams in ((batch, 2), (single, 2), (single, 1)):
            cache = CompressedCache(model, budget=48)
            outputs.append(model.generate(**inputs, past_key_values=cache, max_new_tokens=30, num_beams=beams,
                                          do_sample=False, pad_token_id=tokenizer.pad_token_id))  # fmt: skip
        runs.append((outputs, counted.calls))
    (together, calls), (alone, _) = runs
    assert calls >= 2  # the single prompt without beams evicted together
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(together, alone, strict=True))


def test_the_shared_room_hands_each_layer_its_slice_and_frees_it_with_the_layers():
    room = joint.SharedRoom()
    room.layers = [object()] * 3
    like = torch.zeros(1)
    first = room.room(0, "keys", (2, 4), like)
    second = room.room(1, "keys", (2, 4), like)
    assert first._base is second._base and first._base.shape == (3, 2, 4)
    assert room.base_of("keys", 1, second) is second._base and room.base_of("keys", 0, second) is None
    other = room.room(2, "keys", (2, 5), like)  # another shape: a tensor of its own
    assert other._base is None and other.shape == (2, 5)
    again = room.room(0, "keys", (2, 4), like)  # layer 0 reserves anew: a new shared tensor
    neighbour = room.room(1, "keys", (2, 4), like)
    assert again._base is not first._base and neighbour._base is again._base
    del first, second, again, neighbour
    gc.collect()
    assert room._bases["keys"]() is None  # no layer holds a slice: the room holds nothing either


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


@pytest.mark.parametrize("family", ["qwen3", "phi3", "qwen2"])
def test_other_families_evict_together_as_alone(counted, family):
    """Query norms (Qwen3: each layer makes its own queries), a fused query-key-value projection with partial
    rotation (Phi-3) and biased projections (Qwen2): the layers evict together and keep what they keep alone.
    Their state is read after decoding outside ``no_grad``: scoring the waiting steps then runs a query norm's
    weights, which require gradients, and must still not write a graph into the scores."""
    model = build_family_model(family)
    ids = torch.randint(3, VOCAB, (1, 120), generator=torch.Generator().manual_seed(1))

    def decode(cache) -> list[int]:
        chosen = []
        with torch.no_grad():
            token = model(ids, past_key_values=cache).logits[:, -1:].argmax(dim=-1)
            for _ in range(40):
                chosen.append(int(token))
                token = model(token, past_key_values=cache).logits[:, -1:].argmax(dim=-1)
        return chosen

    together = CompressedCache(model, budget=48, eviction_interval=8)
    tokens = decode(together)
    assert counted.calls >= 3
    counted.off()
    alone = CompressedCache(model, budget=48, eviction_interval=8)
    assert decode(alone) == tokens
    for mine, theirs in zip(_state(together), _state(alone), strict=True):
        for name in ("keys", "values", "positions", "live"):
            assert torch.equal(mine[name], theirs[name]), name
        torch.testing.assert_close(mine["scores"], theirs["scores"])


# settings: whether an eviction's victims can all take the waiting steps' tokens (its last slots, all recent tokens)
FILLS = {
    "budget": ({"budget": 64, "eviction_interval": 8}, True),
    "recent window as long as the interval": ({"budget": 64, "eviction_interval": 8, "recent_tokens": 8}, True),
    "interval past the recent window": ({"budget": 64, "eviction_interval": 9, "recent_tokens": 8}, False),
    "budget at the floor": ({"budget": 36, "eviction_interval": 2}, True),  # one unprotected entry per row goes
    "ratio": ({"compression_ratio": 0.5, "eviction_interval": 8}, True),  # a growing target: fewer go than wait
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


def _live_by_position(layer) -> dict[str, torch.Tensor]:
    """Each row and head's live entries in position order: what the layer keeps, wherever it keeps it."""
    order = layer.positions.masked_fill(~layer.live, -1).argsort(dim=-1, stable=True)[..., -layer.kept :]
    per_entry = {"positions": layer.positions, "scores": layer.scores, "value_norms": layer.value_norms}
    taken = {name: tensor.gather(2, order) for name, tensor in per_entry.items()}
    for name in ("keys", "values"):
        tensor = getattr(layer, name)
        taken[name] = tensor.gather(2, order[..., None].expand(-1, -1, -1, tensor.shape[-1]))
    return taken


@pytest.mark.parametrize("case", list(FILLS))
def test_the_waiting_steps_fill_the_victims_slots_and_keep_what_slot_order_keeps(fresh, monkeypatch, case):
    """Where every victim sits before the waiting steps' tokens (``victims_precede_newest``), those tokens move into
    the victims' slots instead of every kept entry moving forward: the same entries stay, at other slots (the oracle
    is the same cache keeping slot order), two rows of other tokens at once, together and alone."""
    from decodekit.cache import storage
    from decodekit.cache.policy import EvictionPolicy

    model, _ = fresh
    settings, fills = FILLS[case]
    ids = torch.randint(3, model.config.vocab_size, (2, 120), generator=torch.Generator().manual_seed(2))
    moves = []
    for module in (joint, storage):
        real = module.move_tail_into
        monkeypatch.setattr(module, "move_tail_into", lambda *args, real=real: moves.append(1) or real(*args))

    runs = {}
    for order in ("filled", "slot order"):
        if order == "slot order":
            monkeypatch.setattr(EvictionPolicy, "victims_precede_newest", lambda self, drop, newest, keep: False)
        moves.clear()
        cache = CompressedCache(model, **settings)
        runs[order] = (
            _decode_ids(model, ids, cache, 40),
            [_live_by_position(layer) for layer in cache.layers],
            len(moves),
        )
    (tokens, kept, filled), (oracle_tokens, oracle_kept, _) = runs["filled"], runs["slot order"]
    assert (filled > 0) == fills
    assert torch.equal(tokens, oracle_tokens)
    for mine, theirs in zip(kept, oracle_kept, strict=True):
        assert torch.equal(mine["positions"], theirs["positions"])  # the same tokens stay
        # (their keys and values to rounding: attention sums the entries in another order, and later layers see it)
        for name in ("keys", "values", "scores", "value_norms"):
            torch.testing.assert_close(mine[name], theirs[name])


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
def test_filling_the_victims_slots_keeps_what_slot_order_keeps_for_any_settings(
    fresh, monkeypatch, cache_settings, rows, length
):
    """Over drawn settings (the budget's floor, intervals past the recent window, ratios, coded storage, one or two
    rows of prompts of any length), decoding with the fill equals decoding with it switched off: the same tokens and
    positions kept; keys, values and scores to rounding (codes within one step, at under 1% of them)."""
    from decodekit.cache.policy import EvictionPolicy

    model, _ = fresh
    ids = torch.randint(3, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(length))
    runs = []
    for switched_off in (False, True):
        with monkeypatch.context() as patch:
            if switched_off:
                patch.setattr(EvictionPolicy, "victims_precede_newest", lambda self, drop, newest, keep: False)
            cache = CompressedCache(model, **cache_settings)
            runs.append((_decode_ids(model, ids, cache, 30), [_live_by_position(layer) for layer in cache.layers]))
    (tokens, kept), (oracle_tokens, oracle_kept) = runs
    assert torch.equal(tokens, oracle_tokens)
    for mine, theirs in zip(kept, oracle_kept, strict=True):
        assert torch.equal(mine["positions"], theirs["positions"])
        for name in ("keys", "values", "scores"):
            if mine[name].is_floating_point():
                torch.testing.assert_close(mine[name], theirs[name])
            else:  # codes: an input that differs by rounding may land one step away
                assert int((mine[name].int() - theirs[name].int()).abs().max()) <= 1
                assert float((mine[name] != theirs[name]).float().mean()) < 0.01
