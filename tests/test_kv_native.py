"""The cache's C++ coding operator (``_native.encode``) against the PyTorch coding it replaces: byte for byte."""

from __future__ import annotations

import pytest
import torch

from decodekit.cache import _native
from decodekit.cache.quantize import Quantizer


def _torch_coding(quantizer: Quantizer, values: torch.Tensor, dtype: torch.dtype, monkeypatch) -> dict:
    """The PyTorch coding of ``values`` (the operator turned off for the call)."""
    with monkeypatch.context() as patched:
        patched.setattr(_native, "encodes", lambda values: False)
        return quantizer._encode_float(values, dtype, values.shape[-1])


def _values(head_dim: int, seed: int) -> torch.Tensor:
    """Entries of many kinds: normal, large, tiny, one group constant, zeros, a negative constant, ties to round."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(64, 3, head_dim, generator=generator)
    values[1] *= 1e4
    values[2] *= 1e-6
    values[3, :, :8] = 0.37
    values[4] = 0.0
    values[5] = -2.5
    values[6] = torch.arange(head_dim).float() / 2  # codes that land on halves
    values[7] *= 7e4  # past float16's range: infinite scales, as PyTorch's coding gives them
    return values


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("head_dim", "group_size"), [(64, 32), (16, 8), (256, 16)])
def test_the_operator_codes_entries_as_pytorch_does_byte_for_byte(monkeypatch, bits, dtype, head_dim, group_size):
    assert _native.available(), "the C++ operators did not build (a C++ compiler and ninja are needed)"
    quantizer = Quantizer(bits, group_size)
    values = _values(head_dim, seed=bits)
    expected = _torch_coding(quantizer, values, dtype, monkeypatch)
    coded = _native.encode(values, bits, group_size, dtype)
    for name in ("codes", "scales", "offsets"):
        assert coded[name].dtype == expected[name].dtype and coded[name].shape == expected[name].shape, name
        assert torch.equal(coded[name].view(torch.uint8), expected[name].view(torch.uint8)), name


def test_the_quantizer_codes_with_the_operator_on_a_cpu(monkeypatch):
    """``Quantizer.encode`` and ``encode_together`` (two widths) go through the operator where it is built, and give
    the PyTorch coding's bytes."""
    calls = []
    original = _native.encode
    monkeypatch.setattr(_native, "encode", lambda *args: calls.append(args[1]) or original(*args))
    keys, values = _values(64, seed=1), _values(64, seed=2)
    together = Quantizer(4, 32).encode_together([keys, values], torch.float16, [Quantizer(5, 32), Quantizer(4, 32)])
    assert calls == [5, 4]
    monkeypatch.setattr(_native, "encodes", lambda values: False)
    apart = Quantizer(4, 32).encode_together([keys, values], torch.float16, [Quantizer(5, 32), Quantizer(4, 32)])
    for ours, theirs in zip(together, apart, strict=True):
        assert all(torch.equal(ours[name], theirs[name]) for name in ("codes", "scales", "offsets"))


def test_the_row_operators_move_and_write_as_index_copy_does():
    """Oracle: ``index_select`` then ``index_copy_`` of every field (reads before writes, a repeated target slot
    taking one of its rows), on fields of several dtypes and trailing shapes."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 255, (20, 40), dtype=torch.uint8, generator=generator)
    fields = [torch.randn(20, 4, generator=generator).half(), codes, torch.arange(20, dtype=torch.int32),
              torch.randn(20, generator=generator)]  # fmt: skip
    source, target = torch.tensor([3, 7, 7, 1, 19]), torch.tensor([7, 3, 19, 0, 19])
    ours = [tensor.clone() for tensor in fields]
    _native.copy_rows(ours, source, target.int())
    for mine, tensor in zip(ours, fields, strict=True):
        expected = tensor.clone()
        expected.index_copy_(0, target[:4], tensor.index_select(0, source[:4]))  # (the scratch slot 19 set apart)
        assert torch.equal(mine[:19], expected[:19])
        assert torch.equal(mine[19], tensor[7]) or torch.equal(mine[19], tensor[19])
    rows = [torch.randn(3, 4, generator=generator).half(), torch.zeros(3, 40, dtype=torch.uint8),
            torch.tensor([-1, -2, -3], dtype=torch.int32), torch.ones(3)]  # fmt: skip
    index = torch.tensor([2, 11, 5])
    written = [tensor.clone() for tensor in fields]
    _native.write_rows(written, index, rows)
    for mine, tensor, row in zip(written, fields, rows, strict=True):
        assert torch.equal(mine, tensor.clone().index_copy_(0, index, row))
    with pytest.raises(RuntimeError, match="out of range"):
        _native.write_rows(written, torch.tensor([20]), [row[:1] for row in rows])


def test_decay_add_changes_each_segments_entries_as_mul_then_add_does():
    """Oracle: a loop over segments, ``mul_`` then ``add_`` on each segment's first slots up to its length; the
    slots past a segment's length and the scratch slot stay as they were."""
    generator = torch.Generator().manual_seed(3)
    flat = torch.randn(31, generator=generator)
    starts, lengths = torch.tensor([[0, 8], [15, 22]]), torch.tensor([[5, 7], [2, 8]])
    added = torch.randn(2, 2, 6, generator=generator)
    expected = flat.clone()
    for row in range(2):
        for head in range(2):
            start, count = int(starts[row, head]), min(int(lengths[row, head]), 6)
            expected[start : start + count].mul_(0.9).add_(added[row, head, :count])
    _native.decay_add(flat, starts, lengths, added, 0.9)
    assert torch.equal(flat, expected)


def test_moves_within_segments_are_index_copies_from_each_segments_start():
    """Oracle: the flat slots ``start + slot`` of each segment, copied with ``index_select`` then ``index_copy_``
    where the lane is live; the dead lanes move nothing."""
    generator = torch.Generator().manual_seed(5)
    fields = [torch.randn(25, 3, generator=generator), torch.arange(25, dtype=torch.int32)]
    starts = torch.tensor([[0, 6], [12, 18]])
    sources = torch.tensor([[[4, 1], [5, 0]], [[2, 3], [1, 1]]])
    targets = torch.tensor([[[1, 4], [0, 2]], [[0, 0], [3, 3]]])
    lanes = torch.tensor([[[True, True], [True, False]], [[True, False], [False, False]]])
    moved = [tensor.clone() for tensor in fields]
    _native.move_in_segments(moved, starts, sources, targets, lanes)
    source = (starts[..., None] + sources)[lanes]
    target = (starts[..., None] + targets)[lanes]
    for mine, tensor in zip(moved, fields, strict=True):
        assert torch.equal(mine, tensor.clone().index_copy_(0, target, tensor.index_select(0, source)))


def test_appended_rows_land_after_each_segments_entries():
    """Oracle: ``index_copy_`` at ``start + length + i`` for each segment, in (row, head, i) order, and zeros
    written there for the zeroed fields; every other slot unchanged."""
    generator = torch.Generator().manual_seed(6)
    codes, scores = torch.randint(0, 255, (30, 5), dtype=torch.uint8, generator=generator), torch.randn(30)
    starts, lengths = torch.tensor([[0, 7], [14, 22]]), torch.tensor([[3, 5], [0, 6]])
    values = torch.randint(0, 255, (2, 2, 2, 5), dtype=torch.uint8, generator=generator)
    index = ((starts + lengths)[..., None] + torch.arange(2)).flatten()
    expected_codes = codes.clone().index_copy_(0, index, values.reshape(-1, 5))
    expected_scores = scores.clone().index_fill_(0, index, 0.0)
    _native.append_rows([codes], [values], [scores], starts, lengths, 2)
    assert torch.equal(codes, expected_codes) and torch.equal(scores, expected_scores)


def test_a_storage_laid_out_again_keeps_every_segments_entries(monkeypatch):
    """A storage whose segments hold 5, 2, 7 and 0 entries grows one segment and then reorders its rows (a beam's
    reorder): every segment's entries read the same as the PyTorch relayout's (oracle: the operators turned off)."""
    import numpy as np

    from decodekit.cache.storage import EntryStorage, Field

    def build(native: bool) -> EntryStorage:
        with monkeypatch.context() as patched:
            if not native:
                patched.setattr(_native, "runs_on", lambda device: False)
            fields = {"keys": Field((6,), torch.float16), "positions": Field((), torch.int32)}
            storage = EntryStorage(fields, 2, 2, 8, "cpu")
            generator = torch.Generator().manual_seed(7)
            keys = torch.randn(2, 2, 7, 6, generator=generator).half()
            storage.append({"keys": keys, "positions": torch.arange(7, dtype=torch.int32).expand(2, 2, 7)}, 7)
            storage.keep(torch.arange(7).expand(2, 2, 7), np.array([[5, 2], [7, 0]]))
            storage.reserve(np.array([[5, 12], [7, 0]]), room=3)
            storage.select_rows(torch.tensor([1, 0, 1]))
            return storage

    native, oracle = build(True), build(False)
    assert np.array_equal(native.lengths_host, oracle.lengths_host)
    assert np.array_equal(native.capacities, oracle.capacities)
    valid = oracle.valid(7)
    for name in ("keys", "positions"):
        assert torch.equal(native.read(name, 7)[valid], oracle.read(name, 7)[valid])


@pytest.mark.parametrize("case", ["byte-sized", "sliding window", "sliding window, padded rows"])
def test_evicting_one_entry_a_segment_natively_keeps_what_pytorch_keeps(tiny, monkeypatch, case):
    """Oracle: the same cache with the eviction in PyTorch (``protect``, ``lowest``, ``removal_moves``): after each
    of 12 greedy steps every layer keeps the same positions in the same slots and the logits are equal, for the
    byte-sized cache (reconstruction scores, heads of their own lengths, the first layer refit) and for attention
    scores times value norms on a sliding-window model, alone and in a left-padded batch."""
    from decodekit.cache import CompressedCache, fused_step
    from decodekit.cache.layer import CompressedLayer
    from tests.decode_steps import greedy_steps, prompt_batch
    from tests.families import build_family_model
    from tests.tiny import build_model

    calls = []
    original = _native.evict_one
    monkeypatch.setattr(_native, "evict_one", lambda *args: calls.append(1) or original(*args))
    monkeypatch.setattr(fused_step, "STEPS_PLANNED", 0)  # (the operator alone; fused steps: test_kv_fused_step.py)
    if case == "byte-sized":
        model = build_model(tiny[1])
        batch = prompt_batch(tiny[1])
        options = {"memory_fraction": 0.25, "scoring": "reconstruction"}
    else:
        model = build_family_model("mistral-sliding")
        rows = 2 if case.endswith("padded rows") else 1
        ids = torch.randint(3, 300, (rows, 40), generator=torch.Generator().manual_seed(2))
        mask = torch.ones_like(ids)
        mask[1:, :5] = 0  # (the second row left-padded)
        batch = {"input_ids": ids, "attention_mask": mask}
        options = {"budget": 20, "sink_tokens": 2, "recent_tokens": 4, "eviction_interval": 1}

    def run():
        return greedy_steps(model, CompressedCache(model, **options), batch, 12,
                            lambda cache: [layer.storage.read("positions").clone() for layer in cache.layers])

    native = run()
    assert calls, "the operator evicted nothing"
    monkeypatch.setattr(CompressedLayer, "natively_ranked", lambda self: None)
    for (ours, kept), (theirs, expected) in zip(native, run(), strict=True):
        assert torch.equal(ours, theirs)
        assert all(torch.equal(a, b) for a, b in zip(kept, expected, strict=True))


@pytest.mark.parametrize(("key_bits", "value_bits", "dtype"), [(5, 4, torch.float32), (8, 8, torch.bfloat16),
                                                                (4, 5, torch.float16), (3, 2, torch.float32),
                                                                (2, 3, torch.bfloat16)])
def test_a_step_coded_into_the_storage_writes_the_bytes_of_encode_then_append(key_bits, value_bits, dtype):
    """Oracle: ``QuantizedCoding.encode`` of the step's key and value, then ``EntryStorage.append`` with its position,
    a zero score and its value norm, on a copy of the same storage (segments of different lengths and capacities):
    every field's every slot equal, byte for byte, and the lengths one longer."""
    import copy

    import numpy as np

    from decodekit.cache.coding import QuantizedCoding
    from decodekit.cache.storage import EntryStorage, Field

    generator = torch.Generator().manual_seed(9)
    coding = QuantizedCoding(key_bits, value_bits, 8, 0)
    coding.rotated_reads = True
    coding.start(torch.zeros(2, 2, 1, 16, dtype=dtype))
    fields = {**coding.fields(16), "positions": Field((), torch.int32), "scores": Field((), torch.float32),
              "value_norms": Field((), torch.float32)}
    storage = EntryStorage(fields, 2, 2, 4, "cpu")
    keys, values = (torch.randn(2, 2, 9, 16, generator=generator).to(dtype) for _ in range(2))
    entries, _ = coding.encode(keys, values)
    positions = torch.arange(9, dtype=torch.int32).expand(2, 2, 9)
    storage.append({**entries, "positions": positions, "scores": torch.rand(2, 2, 9, generator=generator),
                    "value_norms": torch.rand(2, 2, 9, generator=generator)}, 9)
    storage.keep(torch.arange(9).expand(2, 2, 9), np.array([[9, 4], [6, 2]]))
    storage.reserve(np.array([[10, 5], [12, 3]]))
    oracle = copy.deepcopy(storage)
    key, value = (torch.randn(2, 2, 1, 16, generator=generator).to(dtype) for _ in range(2))
    norms = torch.rand(2, 2, 1, generator=generator)
    read_keys = coding.append_step(storage, key, value, 9, {"scores": 0.0, "value_norms": norms})
    entries, expected_keys = coding.encode(key, value)
    position = torch.full((2, 2, 1), 9, dtype=torch.int32)
    oracle.append({**entries, "positions": position, "scores": 0.0, "value_norms": norms}, 1)
    assert torch.equal(read_keys, expected_keys)
    assert np.array_equal(storage.lengths_host, oracle.lengths_host)
    for name in fields:
        assert torch.equal(storage.flat[name], oracle.flat[name]), name


def test_a_storage_without_a_free_slot_refuses_a_coded_step():
    """``append_coded`` writes after each segment's entries only where every segment has room: a full one is refused
    with a message naming what to do, and nothing is written."""
    from decodekit.cache.coding import QuantizedCoding
    from decodekit.cache.storage import EntryStorage, Field

    coding = QuantizedCoding(4, 4, 8, 0)
    coding.start(torch.zeros(1, 1, 1, 8))
    storage = EntryStorage({**coding.fields(8), "positions": Field((), torch.int32)}, 1, 1, 2, "cpu")
    entries, _ = coding.encode(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8))
    storage.append({**entries, "positions": torch.zeros(1, 1, 2, dtype=torch.int32)}, 2)
    before = {name: tensor.clone() for name, tensor in storage.flat.items()}
    with pytest.raises(ValueError, match="free slot"):
        coding.append_step(storage, torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8), 2, {})
    assert all(torch.equal(storage.flat[name], before[name]) for name in before)


@pytest.mark.parametrize("options", [{"memory_fraction": 0.25, "scoring": "reconstruction"},
                                     {"budget": 40, "kv_bits": 4, "residual_length": 6},
                                     {"budget": 40, "kv_bits": 8, "residual_length": 6, "eviction_interval": 1}])
def test_coded_caches_code_their_steps_natively_as_they_do_in_pytorch(tiny, monkeypatch, options):
    """Oracle: the same cache whose decoding steps are coded by ``encode`` and written by ``append`` (the operator's
    path turned off): after each of 12 greedy steps of a batch of two prompts, every layer holds the same bytes in
    every field's held slots (and the same residual window) and the logits are equal; the operator's path was taken.
    The byte-sized cache, and budgets in 4 and 8 bits with a residual window (steps waiting to be scored, and scored
    at once); the steps that run fused (``fused_step.py``) code their entries with the same operator."""
    from decodekit.cache import CompressedCache
    from decodekit.cache.coding import QuantizedCoding
    from tests.decode_steps import greedy_steps, prompt_batch
    from tests.tiny import build_model

    model = build_model(tiny[1])
    batch = prompt_batch(tiny[1])
    from decodekit.cache.fused_step import FusedSteps

    calls = []
    original = _native.append_coded
    monkeypatch.setattr(_native, "append_coded", lambda *args: calls.append(1) or original(*args))
    fused = FusedSteps.step  # (steps run as one operator code their entries with it: fused_step.py)
    monkeypatch.setattr(FusedSteps, "step", lambda self, *args: calls.append(1) or fused(self, *args))

    def held(cache) -> list[dict[str, torch.Tensor]]:
        return [{**{name: layer.storage.read(name)[layer.storage.valid(layer.storage.length_range[1])]
                    for name in layer.storage.fields},
                 **{name: tensor.clone() for name, tensor in layer.coding.state().items()}}
                for layer in cache.layers]  # fmt: skip

    def run():
        return greedy_steps(model, CompressedCache(model, **options), batch, 12, held)

    native = run()
    assert calls, "no step was coded by the operator"
    monkeypatch.setattr(QuantizedCoding, "appends_steps_natively", lambda self, storage: False)
    for (ours, held), (theirs, expected) in zip(native, run(), strict=True):
        assert torch.equal(ours, theirs)
        for layer, other in zip(held, expected, strict=True):
            assert all(torch.equal(layer[name], other[name]) for name in layer)


def test_the_coded_step_operator_refuses_a_full_segment_itself():
    """Called directly (not through the storage, which checks its free slots first), the operator refuses a segment
    whose length has reached its capacity, though the next segment's slots follow it: nothing is written."""
    coded = [torch.zeros(9, 4, dtype=torch.uint8), torch.zeros(9, 1, dtype=torch.float16),
             torch.zeros(9, 1, dtype=torch.float16)]  # fmt: skip
    positions = torch.full((9,), -1, dtype=torch.int32)
    starts, lengths, capacities = torch.tensor([[0, 4]]), torch.tensor([[4, 1]]), torch.tensor([[4, 4]])
    with pytest.raises(RuntimeError, match="no free slot"):
        _native.append_coded(coded, [torch.randn(1, 2, 1, 8)], [4], 8, positions, 7, [], [], [], starts, lengths,
                             capacities)  # fmt: skip
    assert (positions == -1).all() and all(not tensor.any() for tensor in coded)
