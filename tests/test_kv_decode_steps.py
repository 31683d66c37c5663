"""CompressedCache decoding steps: no device synchronization, and the shortcuts of the steps between
evictions (skipped eviction checks, bookkeeping views extended on read) change nothing."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import decodekit
from decodekit.cache import CompressedCache, joint
from decodekit.cache.layer import CompressedLayer
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
    "reconstruction, layers share": ({"budget": 64, "scoring": "reconstruction", "allocation": "global"}, 1, False),
    # Heads of their own lengths, keys in 5 bits and values in 4, decoded together (the byte-sized cache of the README).
    "reconstruction, sized in bytes": ({"memory_fraction": 0.25, "scoring": "reconstruction"}, 1, False),
}
# Where no decoding step can skip the eviction check: each step evicts one token.
EVERY_STEP_EVICTS = {"budget at the floor", "budget, every step"}


@pytest.mark.parametrize("case", list(CASES))
def test_decoding_steps_never_wait_for_the_device(fresh, case):
    model, tokenizer = fresh
    kwargs, rows, padded = CASES[case]
    cache = CompressedCache(model, **kwargs)
    recorder = SyncRecorder()
    decode_by_hand(model, cache, prompt_batch(tokenizer, rows, padded), steps=30, recorder=recorder)
    assert cache.units[0].kept < cache.units[0].seen - 30  # the prompt was over the size, so the steps evicted
    assert recorder.syncs == []


def test_the_recorder_catches_a_synchronization(fresh, monkeypatch):
    """The check above can fail: a value read during eviction is caught."""
    model, tokenizer = fresh
    keep, evict = CompressedLayer._keep, joint.evict_together
    evictions = []

    def keep_and_read(self, index):
        int(index.max())  # a host read, as a careless change would add
        keep(self, index)

    def evict_and_read(layers, bases, kept):
        evictions.append(kept)
        int(bases["_scores"].argmax())
        evict(layers, bases, kept)

    monkeypatch.setattr(CompressedLayer, "_keep", keep_and_read)
    monkeypatch.setattr(joint, "evict_together", evict_and_read)
    for kwargs, together in (({"budget": 64}, True), ({"budget": 64, "kv_bits": 8}, False)):
        evictions.clear()
        recorder = SyncRecorder()
        decode_by_hand(model, CompressedCache(model, **kwargs), prompt_batch(tokenizer), steps=20, recorder=recorder)
        assert "aten._local_scalar_dense.default" in recorder.syncs
        assert bool(evictions) == together  # the layers evicted together (through the planted read), or alone


def _state(cache: CompressedCache) -> list[tuple[torch.Tensor, ...]]:
    return [(layer.kept_positions(), layer.scores.clone(), layer.keys.clone()) for layer in cache.units]


def _assert_same_state(cache: CompressedCache, reference: CompressedCache) -> None:
    """Every unit of ``cache`` keeps the positions, scores and keys of ``reference``'s."""
    for (positions, scores, keys), (positions_full, scores_full, keys_full) in zip(
        _state(cache), _state(reference), strict=True
    ):
        assert torch.equal(positions, positions_full)
        torch.testing.assert_close(scores, scores_full)
        assert torch.equal(keys, keys_full)


def _recording(monkeypatch, name: str) -> list[int]:
    """Patch ``CompressedLayer.<name>`` to record what it returns; the list of returned values."""
    returned, original = [], getattr(CompressedLayer, name)

    def record(self):
        returned.append(original(self))
        return returned[-1]

    monkeypatch.setattr(CompressedLayer, name, record)
    return returned


@pytest.mark.parametrize("case", list(CASES))
def test_skipping_quiet_steps_changes_nothing(fresh, monkeypatch, case):
    """Decoding equals decoding where every step runs the full eviction check."""
    model, tokenizer = fresh
    kwargs, rows, padded = CASES[case]
    batch = prompt_batch(tokenizer, rows, padded)
    quiet = _recording(monkeypatch, "_steps_without_eviction")
    quick = CompressedCache(model, **kwargs)
    quick_tokens = decode_by_hand(model, quick, batch, steps=30)
    assert (max(quiet) == 0) == (case in EVERY_STEP_EVICTS)  # elsewhere steps were skipped
    monkeypatch.setattr(CompressedLayer, "_steps_without_eviction", lambda self: 0)
    full = CompressedCache(model, **kwargs)
    full_tokens = decode_by_hand(model, full, batch, steps=30)
    assert torch.equal(torch.cat(quick_tokens, dim=-1), torch.cat(full_tokens, dim=-1))
    _assert_same_state(quick, full)


def test_bookkeeping_read_between_evictions_covers_every_entry(fresh):
    """Steps between evictions write keys and values only; reading an entry's position, liveness or value
    norm still sees every stored entry, the newest included."""
    model, tokenizer = fresh
    cache = CompressedCache(model, budget=64, eviction_interval=8)
    decode_by_hand(model, cache, prompt_batch(tokenizer), steps=11)  # the 9th step evicted, two more followed
    layer = cache.layers[1]
    assert layer._lagging
    slots = layer.keys.shape[-2]
    assert layer.positions.shape[-1] == layer.live.shape[-1] == layer.value_norms.shape[-1] == slots
    assert int(layer.positions.max()) == layer.seen - 1
    assert bool(layer.live.all())
    newest = layer.values[:, :, -1].float().norm(dim=-1)
    torch.testing.assert_close(layer.value_norms[:, :, -1], newest)


def _decode_with_interruptions(model, cache, batch, steps: int) -> torch.Tensor:
    """Greedy decoding by hand, with between evictions: the last two tokens cropped and fed again (step 9), the
    rows swapped as a beam reorder does (step 14), and the first layer's keys and values replaced by other tensors,
    as an offload does, the keys changed besides (step 20). Returns the tokens."""
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
            if step == 20:
                first = cache.layers[0]
                if isinstance(first, CompressedLayer):
                    changed = first.keys + 1e-3 if first.keys.is_floating_point() else first.keys.clone()  # (or codes)
                    first.keys, first.values = changed, first.values.clone()
    return tokens


def test_keys_replaced_from_outside_are_not_kept_alive_by_the_layer(fresh):
    """A layer remembers the keys and values it placed (to tell them from ones put there from outside) without
    holding them: keys replaced from outside, as an offload does, are freed."""
    import gc
    import weakref

    model, tokenizer = fresh
    cache = CompressedCache(model, budget=64, eviction_interval=1)  # no reserved room: nothing else holds the keys
    batch = prompt_batch(tokenizer)
    with torch.no_grad():
        model(**batch, past_key_values=cache)
    layer = cache.layers[0]
    assert layer._spare is None and layer._was_placed("keys", layer.keys)
    replaced = weakref.ref(layer.keys)
    layer.keys = layer.keys.clone()
    gc.collect()
    assert replaced() is None and not layer._was_placed("keys", layer.keys)


@pytest.mark.parametrize("case", list(CASES))
def test_plain_steps_change_nothing(fresh, monkeypatch, case):
    """Decoding where a step between evictions skips the checks the step before it made equals decoding where
    every step checks in full, through a crop, a beam reorder and keys replaced from outside between evictions."""
    model, tokenizer = fresh
    kwargs, rows, padded = CASES[case]
    batch = prompt_batch(tokenizer, rows or 2, padded)
    left = _recording(monkeypatch, "_plain_steps_left")
    quick = CompressedCache(model, **kwargs)
    quick_tokens = _decode_with_interruptions(model, quick, batch, steps=30)
    # (at the budget's floor, the one step after each eviction appends to the room it left)
    takes_plain_steps = not (quick.units[0].quantized or padded or kwargs.get("eviction_interval") == 1)
    assert (max(left, default=0) > 0) == takes_plain_steps
    monkeypatch.setattr(CompressedLayer, "_plain_steps_left", lambda self: 0)
    full = CompressedCache(model, **kwargs)
    full_tokens = _decode_with_interruptions(model, full, batch, steps=30)
    assert torch.equal(quick_tokens, full_tokens)
    _assert_same_state(quick, full)


@pytest.mark.parametrize("case", ["budget", "ratio", "padded rows"])
def test_views_of_the_room_made_once_change_nothing(fresh, monkeypatch, case):
    """Eager steps and evictions reuse their views of the reserved room (``_kept_room_view``) from one interval to the
    next: decoding equals decoding that makes them anew each time, through a crop, a beam reorder and keys replaced
    from outside (each gives up or replaces the room)."""
    from decodekit.cache.storage import EntryStorage

    model, tokenizer = fresh
    kwargs, rows, padded = CASES[case]
    batch = prompt_batch(tokenizer, rows or 2, padded)
    reused = []
    real = EntryStorage._kept_room_view

    def recording(self, name, start, length):
        reused.append((name, start, length) in self._room_views)
        return real(self, name, start, length)

    monkeypatch.setattr(EntryStorage, "_kept_room_view", recording)
    cache = CompressedCache(model, **kwargs)
    tokens = _decode_with_interruptions(model, cache, batch, steps=30)
    assert any(reused) or padded  # (a padded batch's steps score at once: no room, no views)
    monkeypatch.setattr(
        EntryStorage, "_kept_room_view", lambda self, name, start, length: self._spare[name].narrow(2, start, length)
    )
    fresh_views = CompressedCache(model, **kwargs)
    assert torch.equal(tokens, _decode_with_interruptions(model, fresh_views, batch, steps=30))
    _assert_same_state(cache, fresh_views)


def _tensors_held(value, depth: int = 0) -> list[torch.Tensor]:
    """The tensors in ``value`` and in the dicts, lists and tuples it holds (a layer's attributes)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 4 or not isinstance(value, dict | list | tuple):
        return []
    items = value.values() if isinstance(value, dict) else value
    return [tensor for item in items for tensor in _tensors_held(item, depth + 1)]


def test_reset_lets_go_of_every_tensor(fresh):
    """After reset no layer holds a tensor (its reserved room is freed, with the steps' views of it), directly or in
    a dict, list or tuple, reset between evictions too."""
    model, tokenizer = fresh
    cache = CompressedCache(model, budget=64, eviction_interval=8)
    decode_by_hand(model, cache, prompt_batch(tokenizer), steps=11)  # the 9th step evicted, two plain steps followed
    assert cache.layers[0]._plain_steps > 0
    assert _tensors_held(cache.layers[0]._room_views)  # (what reset must let go of)
    cache.reset()
    for layer in cache.layers:
        assert [name for name, value in vars(layer).items() if _tensors_held(value)] == []
