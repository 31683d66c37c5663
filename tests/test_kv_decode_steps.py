"""CompressedCache decoding steps: no device synchronization, and the shortcuts of the steps between
evictions (scoring that waits for the next eviction, evictions that move only the newest entries) change nothing."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import decodekit
from decodekit.cache import CompressedCache, _native, joint
from decodekit.cache import layer as layer_module
from decodekit.cache.eviction import removal_moves
from decodekit.cache.fused_step import FusedSteps
from decodekit.cache.scorers.attention import AttentionScorer
from decodekit.cache.storage import EntryStorage
from tests.decode_steps import decode_by_hand, prompt_batch
from tests.tiny import build_model

# Operators that make the host wait for the device: reading a value (item, int(), float(), bool()), and
# those whose output shape depends on tensor contents.
SYNCING = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
    "aten.repeat_interleave.Tensor",
}


PACKAGE = str(Path(decodekit.__file__).parent)


def _from_decodekit() -> bool:
    """Whether decodekit's code is on the call stack (transformers' own mask code reads a value when an
    attention mask is passed, with any cache)."""
    return any(frame.filename.startswith(PACKAGE) for frame in traceback.extract_stack())


class SyncRecorder(TorchDispatchMode):
    """Records every operator that synchronizes with the device, and every boolean-mask index, that
    decodekit's code runs."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        indices = args[1] if name.startswith(("aten.index.", "aten.index_put")) and len(args) > 1 else ()
        masks = [index for index in indices if isinstance(index, torch.Tensor) and index.dtype == torch.bool]
        if (name in SYNCING or masks) and _from_decodekit():
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fresh(tiny):
    _, tokenizer = tiny
    return build_model(tokenizer), tokenizer


# name: (cache settings, rows, left-padded); the prompt has 186 tokens (the padded row 93).
CASES = {
    "budget": ({"budget": 64}, 1, False),
    "budget at the floor": ({"budget": 36}, 1, False),
    "budget, every step": ({"budget": 64, "eviction_interval": 1}, 1, False),
    "ratio": ({"compression_ratio": 0.5}, 1, False),
    "padded rows": ({"budget": 64}, 2, True),
    "bytes": ({"memory_fraction": 0.5}, 2, False),
    "bytes, all rows": ({"max_bytes": 60_000}, 2, False),
    "4 bits": ({"budget": 64, "kv_bits": 4}, 1, False),
    "reconstruction": ({"budget": 64, "scoring": "reconstruction"}, 1, False),  # heads of their own lengths
    "reconstruction, layers share": ({"budget": 64, "scoring": "reconstruction", "allocation": "layers"}, 1, False),
    # Heads of their own lengths, keys in 5 bits and values in 4, decoded together (the byte-sized cache of the README).
    "reconstruction, sized in bytes": ({"memory_fraction": 0.25, "scoring": "reconstruction"}, 1, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decoding_steps_never_wait_for_the_device(fresh, case):
    model, tokenizer = fresh
    kwargs, rows, padded = CASES[case]
    cache = CompressedCache(model, **kwargs)
    recorder = SyncRecorder()
    decode_by_hand(model, cache, prompt_batch(tokenizer, rows, padded), steps=30, recorder=recorder)
    assert cache.layers[0].kept < cache.layers[0].seen - 30  # the prompt was over the size, so the steps evicted
    assert recorder.syncs == []


def test_the_recorder_catches_a_synchronization(fresh, monkeypatch):
    """The check above can fail: a value read while entries move is caught, in every kind of eviction (a few entries
    moved, alone or with the other layers, and every kept entry packed)."""
    model, tokenizer = fresh
    keep = EntryStorage.keep
    moved = []

    def moves_and_read(victims, lengths, drops):
        moved.append(int(victims.max()))  # a host read, as a careless change would add
        return removal_moves(victims, lengths, drops)

    def keep_and_read(self, slots, counts):
        int(slots.max())
        keep(self, slots, counts)

    monkeypatch.setattr(layer_module, "removal_moves", moves_and_read)
    monkeypatch.setattr(joint, "removal_moves", moves_and_read)
    monkeypatch.setattr(EntryStorage, "keep", keep_and_read)
    for kwargs in ({"budget": 64}, {"budget": 64, "kv_bits": 8}):
        recorder = SyncRecorder()
        decode_by_hand(model, CompressedCache(model, **kwargs), prompt_batch(tokenizer), steps=20, recorder=recorder)
        assert "aten._local_scalar_dense.default" in recorder.syncs
    assert moved  # the steps' evictions moved entries (and were caught reading)


def _state(cache: CompressedCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the kept positions and the scores in position order (slot order is free)."""
    state = []
    for layer in cache.layers:
        positions, scores = layer.positions(), layer.scores()
        order = positions.argsort(dim=-1)
        state.append((positions.gather(-1, order), scores.gather(-1, order)))
    return state


def _assert_same_state(cache: CompressedCache, reference: CompressedCache) -> None:
    """Every layer of ``cache`` keeps the positions of ``reference``'s, with its scores (to rounding: sums are made
    in another order; with coded storage a waiting step's scoring reads the newest keys from the residual window, in
    16 bits, where a step scored at once reads its own key exact)."""
    coded = cache.options.storage.coded
    tolerance = {"atol": 1e-4, "rtol": 1e-3} if coded else {}
    for (positions, scores), (positions_full, scores_full) in zip(_state(cache), _state(reference), strict=True):
        assert torch.equal(positions, positions_full)
        torch.testing.assert_close(scores, scores_full, **tolerance)


def _decode_with_interruptions(model, cache, batch, steps: int) -> torch.Tensor:
    """Greedy decoding by hand, with between evictions: the last two tokens cropped and fed again (step 9) and the
    rows swapped as a beam reorder does (step 14). Returns the tokens."""
    tokens, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        logits = model(**batch, past_key_values=cache).logits[:, -1]

        def feed(token):
            nonlocal mask
            mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
            positions = (mask.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
            step = {"input_ids": token, "attention_mask": mask, "position_ids": positions, "past_key_values": cache}
            return model(**step).logits[:, -1]

        for step in range(steps):
            token = logits.argmax(dim=-1, keepdim=True)
            tokens = torch.cat([tokens, token], dim=-1)
            logits = feed(token)
            if step == 9:
                cache.crop(-2)
                mask = mask[:, :-2]
                for again in tokens[:, -2:].split(1, dim=-1):
                    logits = feed(again)
            if step == 14 and tokens.shape[0] == 2:
                swap = torch.tensor([1, 0])
                cache.reorder_cache(swap)
                tokens, mask, logits = tokens[swap], mask[swap], logits[swap]
    return tokens


@pytest.mark.parametrize("case", list(CASES))
def test_waiting_scores_and_moves_of_the_newest_entries_change_nothing(fresh, monkeypatch, case):
    """Decoding where steps between evictions wait for their scoring and evictions of a few entries move the newest
    ones into the victims' slots equals decoding where every step is scored at once and every eviction packs the
    kept entries in slot order, through a crop and a beam reorder."""
    model, tokenizer = fresh
    kwargs, rows, padded = CASES[case]
    batch = prompt_batch(tokenizer, rows or 2, padded)
    waited, moved = [], []
    may_wait = AttentionScorer.may_wait

    def recording_wait(self, layer, step):
        waited.append(may_wait(self, layer, step))
        return waited[-1]

    def recording_moves(*args, **kwargs):
        moved.append(True)
        return removal_moves(*args, **kwargs)

    evict_one = _native.evict_one

    def recording_evict_one(*args):
        moved.append(True)
        return evict_one(*args)

    monkeypatch.setattr(AttentionScorer, "may_wait", recording_wait)
    monkeypatch.setattr(layer_module, "removal_moves", recording_moves)  # (alone)
    monkeypatch.setattr(joint, "removal_moves", recording_moves)  # (with the other layers)
    monkeypatch.setattr(_native, "evict_one", recording_evict_one)  # (one entry a segment, on a CPU)
    fused = FusedSteps.step  # (a step run as one operator evicts one entry a segment as evict_one does)
    monkeypatch.setattr(FusedSteps, "step", lambda self, *args: moved.append(True) or fused(self, *args))
    quick = CompressedCache(model, **kwargs)
    quick_tokens = _decode_with_interruptions(model, quick, batch, steps=30)
    assert any(waited) == (quick.options.size.eviction_interval > 1)
    assert moved
    monkeypatch.setattr(AttentionScorer, "may_wait", lambda self, layer, step: False)
    for module in (layer_module, joint):
        monkeypatch.setattr(module, "removal_moves", lambda *args, **kwargs: pytest.fail("an eviction moved entries"))
    monkeypatch.setattr(_native, "evict_one", lambda *args: pytest.fail("an eviction moved entries"))
    monkeypatch.setattr("decodekit.cache.layer.MOVES_AT_MOST", 0.0)
    full = CompressedCache(model, **kwargs)
    full_tokens = _decode_with_interruptions(model, full, batch, steps=30)
    assert torch.equal(quick_tokens, full_tokens)
    _assert_same_state(quick, full)


def _tensors_held(value, seen: set[int], depth: int = 0) -> list[torch.Tensor]:
    """The tensors in ``value``: itself, or in the dicts, lists, tuples and decodekit objects it holds."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 6 or id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, list | tuple):
        items = list(value)
    elif type(value).__module__.startswith("decodekit.cache") and hasattr(value, "__dict__"):
        items = list(vars(value).values())
    else:
        return []
    return [tensor for item in items for tensor in _tensors_held(item, seen, depth + 1)]


def test_reset_lets_go_of_every_tensor(fresh):
    """After reset no layer holds a tensor, directly or through its parts (storage, coding, scorer), reset with
    decoding steps waiting to be scored too."""
    model, tokenizer = fresh
    for kwargs in ({"budget": 64, "eviction_interval": 8}, {"budget": 64, "kv_bits": 4}):
        cache = CompressedCache(model, **kwargs)
        decode_by_hand(model, cache, prompt_batch(tokenizer), steps=11)  # the 9th step evicted, two steps wait
        assert _tensors_held(cache.layers[0], set())  # (what reset must let go of)
        cache.reset()
        for layer in cache.layers:
            assert _tensors_held(layer, set()) == []
