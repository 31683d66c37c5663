"""A compressed cache saved to a file, loaded and forked: it continues as the cache compressed in place (the oracle,
compressed again in the same process and never saved), bit for bit on the CPU; files that do not fit are refused in
one line; a save stopped midway leaves no partial file; the file holds what the cache holds."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from decodekit.cache import CompressedCache, persist
from tests import kv_format_file
from tests.families import build_family_model
from tests.tiny import build_model

ROOT = Path(__file__).resolve().parent.parent
DOCUMENT_TOKENS = 260
QUESTION_TOKENS = 9
NEW_TOKENS = 24


@pytest.fixture
def fresh(tiny):
    """A fresh copy of the tiny model, so that hooks bound in one test never reach another."""
    _, tokenizer = tiny
    return build_model(tokenizer), tokenizer


def _ids(rows: int, tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 384, (rows, tokens), generator=torch.Generator().manual_seed(seed))


def _compressed(model, options, document, mask=None) -> CompressedCache:
    """The document compressed in place: the prompt's pass of a fresh cache."""
    cache = CompressedCache(model, **options)
    with torch.no_grad():
        model(document, attention_mask=mask, past_key_values=cache)
    return cache


def _follow_up(model, cache, document, question, mask=None, new_tokens=NEW_TOKENS):
    """A question asked after the document: one pass of its tokens, then greedy steps; the tokens and every step's
    logits."""
    mask = torch.ones_like(document) if mask is None else mask
    ids = torch.cat([document, question], dim=1)
    with torch.no_grad():
        output = model.generate(
            ids, attention_mask=torch.cat([mask, torch.ones_like(question)], dim=1), past_key_values=cache,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=2,
        )  # fmt: skip
    return output.sequences, torch.stack(output.logits)


def _held(cache) -> list[torch.Tensor]:
    return [tensor.clone() for layer in cache.layers for tensor in layer.held_tensors()]


# Every allocation, plain and coded storage (16 bits of a float32 model, 8, 5, 4, 3 and 2 bits, a residual window),
# refit (matched) layers, each scorer, each way of sizing, float32 and bfloat16.
CASES = [
    ({"budget": 48}, torch.float32),
    ({"budget": 48}, torch.bfloat16),
    ({"compression_ratio": 0.6, "scoring": "attention+novelty", "kv_bits": 8}, torch.float32),
    ({"memory_fraction": 0.2, "scoring": "reconstruction"}, torch.float32),
    ({"memory_fraction": 0.2, "scoring": "reconstruction"}, torch.bfloat16),
    ({"budget": 48, "scoring": "reconstruction", "allocation": "layers", "kv_bits": 4, "matched_layers": 1},
     torch.float32),
    ({"budget": 48, "scoring": "reconstruction", "allocation": "heads", "kv_bits": 16, "matched_layers": 2},
     torch.float32),
    ({"budget": 48, "scoring": "reconstruction", "allocation": "heads", "kv_bits": 4, "residual_length": 8},
     torch.bfloat16),
    ({"budget": 48, "scoring": "reconstruction", "kv_bits": 5, "matched_layers": 0}, torch.float32),
    ({"memory_fraction": 0.2, "scoring": "reconstruction", "kv_bits": 2, "key_bits": 3}, torch.bfloat16),
    ({"budget": 48, "scoring": "reconstruction", "replay": "prompt_queries"}, torch.bfloat16),
]  # fmt: skip


@pytest.mark.parametrize(("options", "dtype"), CASES)
def test_a_loaded_cache_continues_bit_for_bit_as_the_cache_compressed_in_place(fresh, tmp_path, options, dtype):
    model, _ = fresh
    model.to(dtype)
    document, question = _ids(1, DOCUMENT_TOKENS, 0), _ids(1, QUESTION_TOKENS, 1)
    path = _compressed(model, options, document).save(tmp_path / "doc.kv", token_ids=document)
    loaded = CompressedCache.load(path, model)
    in_place = _compressed(model, options, document)  # the oracle: never saved
    assert loaded.get_seq_length() == in_place.get_seq_length() == DOCUMENT_TOKENS
    assert loaded.memory_bytes() == in_place.memory_bytes() and loaded.kept_tokens == in_place.kept_tokens
    tokens, logits = _follow_up(model, loaded, document, question)
    expected_tokens, expected_logits = _follow_up(model, in_place, document, question)
    assert torch.equal(logits, expected_logits) and torch.equal(tokens, expected_tokens)
    seen = DOCUMENT_TOKENS + QUESTION_TOKENS + NEW_TOKENS - 1
    assert loaded.get_seq_length() == seen and loaded.kept_tokens < seen  # the follow-up evicted as it went


def test_a_cache_saved_between_decoding_steps_with_steps_waiting_continues_as_it_would_have(fresh, tmp_path):
    """Saved after decoding steps whose scoring waits for the next eviction (an interval of 6): the save scores
    them, as the eviction would have, and the loaded cache goes on as the one never saved."""
    model, _ = fresh
    options = {"budget": 48, "eviction_interval": 6}
    document, question = _ids(1, DOCUMENT_TOKENS, 2), _ids(1, QUESTION_TOKENS, 3)
    saved, in_place = _compressed(model, options, document), _compressed(model, options, document)
    asked, _ = _follow_up(model, saved, document, question, new_tokens=9)
    _follow_up(model, in_place, document, question, new_tokens=9)
    assert any(layer.scorer.held_tensors() for layer in saved.layers)  # steps are waiting
    loaded = CompressedCache.load(saved.save(tmp_path / "mid.kv"), model)
    settings = {"max_new_tokens": 20, "min_new_tokens": 20, "do_sample": False, "output_logits": True,
                "return_dict_in_generate": True, "pad_token_id": 2}  # fmt: skip
    with torch.no_grad():
        follow = [model.generate(asked, attention_mask=torch.ones_like(asked), past_key_values=cache, **settings)
                  for cache in (loaded, in_place)]  # fmt: skip
    assert torch.equal(torch.stack(follow[0].logits), torch.stack(follow[1].logits))


def test_a_fork_answers_as_the_original_would_and_leaves_it_unchanged(fresh):
    model, _ = fresh
    options = {"memory_fraction": 0.2, "scoring": "reconstruction"}
    document, first, second = _ids(1, DOCUMENT_TOKENS, 4), _ids(1, QUESTION_TOKENS, 5), _ids(1, 12, 6)
    original = _compressed(model, options, document)
    before = _held(original)
    fork = original.fork()
    _, answer = _follow_up(model, fork, document, first)
    _, expected = _follow_up(model, _compressed(model, options, document), document, first)
    assert torch.equal(answer, expected)
    assert fork.get_seq_length() > original.get_seq_length() == DOCUMENT_TOKENS
    after = _held(original)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    _, from_original = _follow_up(model, original, document, second)  # the next question, from the document
    _, expected = _follow_up(model, _compressed(model, options, document), document, second)
    assert torch.equal(from_original, expected)


@pytest.mark.parametrize(
    ("options", "padding_held"),
    [({"budget": 48}, False), ({"budget": 48, "kv_bits": 4}, False), ({"budget": 400}, True)],
)
def test_a_padded_batch_keeps_each_rows_state_through_a_save(fresh, tmp_path, options, padding_held):
    """Two documents of 260 and 200 tokens, left-padded: each row keeps its own entries and padding (held in place
    until a first eviction, here never reached under a budget of 400) and continues as in place."""
    model, _ = fresh
    document = _ids(2, DOCUMENT_TOKENS, 7)
    mask = torch.ones_like(document)
    mask[1, :60] = 0
    document[1, :60] = 2
    question = _ids(2, QUESTION_TOKENS, 8)
    saved = _compressed(model, options, document, mask)
    assert all(layer.padding_held == padding_held for layer in saved.layers)
    loaded = CompressedCache.load(saved.save(tmp_path / "rows.kv", token_ids=document), model)
    in_place = _compressed(model, options, document, mask)
    for layer, expected in zip(loaded.layers, in_place.layers, strict=True):
        assert layer.padding_held == padding_held and layer.held_pads.tolist() == expected.held_pads.tolist()
        assert torch.equal(layer.kept_positions(), expected.kept_positions())  # each row's own tokens
    assert loaded.token_ids == document.tolist()
    _, logits = _follow_up(model, loaded, document, question, mask)
    _, expected = _follow_up(model, in_place, document, question, mask)
    assert torch.equal(logits, expected)


def test_the_file_holds_what_the_cache_holds_within_five_percent_plus_its_header(fresh, tmp_path):
    model, _ = fresh
    document = _ids(1, 900, 9)
    heads = {"compression_ratio": 0.5, "scoring": "reconstruction", "allocation": "heads", "kv_bits": 4}
    for options in ({"budget": 64}, {"memory_fraction": 0.1, "scoring": "reconstruction"}, heads):
        cache = _compressed(model, options, document)
        path = cache.save(tmp_path / "size.kv", token_ids=document)
        with open(path, "rb") as file:
            header = 8 + struct.unpack("<Q", file.read(8))[0]  # safetensors: the header's length, then the header
        expected = cache.memory_bytes() + header
        assert abs(path.stat().st_size - expected) <= 0.05 * expected, (options, path.stat().st_size, expected)


def test_the_header_records_the_tokens_held_and_refuses_ids_that_do_not_match(fresh, tmp_path):
    model, _ = fresh
    document = _ids(1, DOCUMENT_TOKENS, 10)
    cache = _compressed(model, {"budget": 48}, document)
    path = cache.save(tmp_path / "ids.kv", token_ids=document[0].tolist(), metadata={"source": "report.txt"})
    header = persist.read_header(path)
    assert header["token_ids"] == document[0].tolist() and header["metadata"] == {"source": "report.txt"}
    assert header["dtype"] == "float32" and header["version"] == persist.VERSION
    assert CompressedCache.load(path, model).token_ids == document[0].tolist()
    with pytest.raises(ValueError, match=f"token_ids holds 259 tokens per row; the cache has seen {DOCUMENT_TOKENS}"):
        cache.save(tmp_path / "short.kv", token_ids=document[0, 1:].tolist())
    with pytest.raises(ValueError, match=r"token_ids holds 2 row\(s\); the cache holds 1"):
        cache.save(tmp_path / "rows.kv", token_ids=[[1] * DOCUMENT_TOKENS] * 2)
    assert not (tmp_path / "short.kv").exists() and not (tmp_path / "rows.kv").exists()
    with pytest.raises(ValueError, match="can be saved once its prompt has been seen"):
        CompressedCache(model, budget=48).save(tmp_path / "empty.kv")


# -- refusals ---------------------------------------------------------------------------------------------------


@pytest.fixture
def saved(fresh, tmp_path):
    """A cache of the tiny model saved to a file: (model, tokenizer, path)."""
    model, tokenizer = fresh
    cache = _compressed(model, {"budget": 48, "kv_bits": 4}, _ids(1, DOCUMENT_TOKENS, 11))
    return model, tokenizer, cache.save(tmp_path / "doc.kv")


def _refused(path, model, message):
    with pytest.raises(ValueError, match=message) as raised:
        CompressedCache.load(path, model)
    assert "\n" not in str(raised.value)  # one line
    return str(raised.value)


def test_a_file_for_another_model_is_refused_naming_what_differs(saved):
    _, tokenizer, path = saved
    _refused(path, build_family_model("qwen2"), "saved for another model: config model_type is 'llama' there and "
                                                "'qwen2' here")  # fmt: skip
    _refused(path, build_model(tokenizer, num_layers=3), "config num_hidden_layers is 2 there and 3 here")


def test_another_checkpoint_of_the_same_architecture_is_refused_even_when_one_weight_differs(saved):
    model, tokenizer, path = saved
    _refused(path, build_model(tokenizer, seed=1), "saved for another checkpoint of this architecture")
    near = build_model(tokenizer)
    near.load_state_dict(model.state_dict())
    CompressedCache.load(path, near)  # the same weights: accepted
    with torch.no_grad():  # one value in the middle of the embedding, where no sampling of the weights would look
        near.model.embed_tokens.weight[200, 33] += 1e-6
    _refused(path, near, "another checkpoint")


def test_a_file_from_a_model_in_another_dtype_is_refused(saved):
    _, tokenizer, path = saved
    other = build_model(tokenizer).to(torch.bfloat16)
    _refused(path, other, "saved from a float32 model; this one is bfloat16: load it in that dtype")


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.01, 12])
def test_a_truncated_file_is_refused(saved, keep):
    model, _, path = saved
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    _refused(path, model, "is not a readable decodekit cache file")


def test_a_corrupted_file_is_refused(saved):
    model, _, path = saved
    data = bytearray(path.read_bytes())
    header = 8 + struct.unpack("<Q", data[:8])[0]
    tensor_byte = header + (len(data) - header) // 2
    data[tensor_byte] ^= 0x01  # one bit of one stored entry
    path.write_bytes(bytes(data))
    _refused(path, model, "is corrupted: its contents do not match the checksum")
    data[tensor_byte] ^= 0x01
    text = bytes(data[8:header]).decode()
    seen = '\\"seen\\": 260'  # a number in the JSON header, still valid JSON once changed
    assert seen in text
    path.write_bytes(bytes(data[:8]) + text.replace(seen, '\\"seen\\": 261', 1).encode() + bytes(data[header:]))
    _refused(path, model, "is corrupted")
    path.write_bytes(b"\x00" * 16 + bytes(data[24:]))
    _refused(path, model, "is not a readable decodekit cache file")
    path.write_text("not a cache at all")
    _refused(path, model, "is not a readable decodekit cache file")


def _rewrite_header(path, change) -> None:
    with safe_open(str(path), framework="pt") as file:
        tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118
        header = json.loads(file.metadata()["decodekit"])
    change(header)
    save_file(tensors, path, metadata={"decodekit": json.dumps(header)})


def test_a_newer_or_older_format_version_is_refused(saved):
    model, _, path = saved
    _rewrite_header(path, lambda header: header.update(version=persist.VERSION + 1))
    _refused(path, model, f"written in format version {persist.VERSION + 1}; this decodekit reads version "
                          f"{persist.VERSION}: upgrade decodekit")  # fmt: skip
    _rewrite_header(path, lambda header: header.update(version=min(persist.READS) - 1))
    _refused(path, model, "which this decodekit no longer reads")
    _rewrite_header(path, lambda header: header.update(format="something-else"))
    _refused(path, model, "is not a decodekit cache file")


def test_a_missing_file_or_a_folder_is_named(fresh, tmp_path):
    model, _ = fresh
    _refused(tmp_path / "nothing.kv", model, "nothing.kv: no such file")
    _refused(tmp_path, model, "is a folder")


# -- atomic saves ---------------------------------------------------------------------------------------------


def _partial_writer(stop):
    """A stand-in for safetensors' writer: half the file, then ``stop()``."""

    def write(tensors, filename, metadata=None):
        save_file(tensors, filename, metadata=metadata)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        stop()

    return write


def test_a_save_interrupted_midway_leaves_the_previous_file_and_no_partial_one(saved, monkeypatch):
    model, _, path = saved
    before = path.read_bytes()
    cache = _compressed(model, {"budget": 64}, _ids(1, DOCUMENT_TOKENS, 12))

    def interrupt():
        raise KeyboardInterrupt

    monkeypatch.setattr(persist, "save_file", _partial_writer(interrupt))
    with pytest.raises(KeyboardInterrupt):
        cache.save(path)
    assert path.read_bytes() == before and sorted(os.listdir(path.parent)) == [path.name]
    new = path.with_name("new.kv")
    with pytest.raises(KeyboardInterrupt):
        cache.save(new)
    assert not new.exists() and sorted(os.listdir(path.parent)) == [path.name]


KILLED_SAVE = """
import os, signal, sys, torch
sys.path.insert(0, {root!r})
import decodekit.cache.persist as persist
from decodekit.cache import CompressedCache
from tests.test_kv_reuse import _partial_writer
from tests.tiny import build_model, build_tokenizer
model = build_model(build_tokenizer())
cache = CompressedCache(model, budget=48)
with torch.no_grad():
    model(torch.arange(3, 200)[None], past_key_values=cache)
persist.save_file = _partial_writer(lambda: os.kill(os.getpid(), signal.SIGKILL))
cache.save({path!r})
"""


def test_a_save_killed_midway_leaves_no_file_and_the_next_save_removes_its_temporary(fresh, tmp_path):
    target = tmp_path / "killed.kv"
    script = KILLED_SAVE.format(root=str(ROOT), path=str(target))
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, timeout=300, check=False)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    assert not target.exists()
    (left,) = os.listdir(tmp_path)  # the killed save's temporary, under a hidden name
    assert left.startswith(".killed.kv.") and left.endswith(".partial")
    model, _ = fresh
    _compressed(model, {"budget": 48}, _ids(1, DOCUMENT_TOKENS, 13)).save(target)
    assert os.listdir(tmp_path) == ["killed.kv"]
    CompressedCache.load(target, model)


def test_saving_to_a_missing_folder_or_a_folder_is_refused(fresh, tmp_path):
    model, _ = fresh
    cache = _compressed(model, {"budget": 48}, _ids(1, DOCUMENT_TOKENS, 14))
    with pytest.raises(ValueError, match=r"the folder .* does not exist"):
        cache.save(tmp_path / "no" / "such.kv")
    with pytest.raises(ValueError, match="is a folder: give a file name"):
        cache.save(tmp_path)


# -- the format --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", persist.READS)
def test_the_file_of_each_format_version_read_loads_and_continues_as_the_cache_compressed_anew(version):
    """``tests/data``'s file of each version read (``tests/kv_format_file.py``): it must load, hold the fields, dtypes
    and shapes a cache compressed anew as that version's was holds now, and answer as that cache. A change to what a
    cache saves fails here: raise ``persist.VERSION`` and write its file."""
    model = kv_format_file.integer_model()
    path = kv_format_file.file_of(version)
    assert path.exists(), "write persist.VERSION's file: python -m tests.kv_format_file"
    loaded = CompressedCache.load(path, model)
    anew = kv_format_file.compressed(model, version)
    assert loaded.options.storage.smooth_keys is (version > 1)
    for old, new in zip(loaded.layers, anew.layers, strict=True):
        (old_tensors, old_numbers), (new_tensors, new_numbers) = old.state(), new.state()
        assert old_numbers.keys() == new_numbers.keys()
        assert {name: (t.dtype, t.shape) for name, t in old_tensors.items()} == {
            name: (t.dtype, t.shape) for name, t in new_tensors.items()
        }
    assert loaded.token_ids == kv_format_file.DOCUMENT
    document, question = torch.tensor([kv_format_file.DOCUMENT]), torch.tensor([kv_format_file.QUESTION])
    _, logits = _follow_up(model, loaded, document, question, new_tokens=8)
    _, expected = _follow_up(model, anew, document, question, new_tokens=8)
    # The file was compressed on another CPU, whose float reductions may round a few float16 scales, offsets and
    # biases one unit apart from this one's compression: logits then differ by about 2e-4.
    torch.testing.assert_close(logits, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.slow  # the default model: its 28M-value embedding, where a sampled fingerprint once indexed past the end
def test_the_default_model_saves_and_loads_a_context_that_answers_as_in_place(real, tmp_path):
    from pydoc_data.topics import topics

    from decodekit.context import Context

    model, tokenizer = real
    options = {"memory_fraction": 0.1, "scoring": "reconstruction"}
    document = topics["assert"] + topics["pass"]
    context = Context.compress(model, tokenizer, document, CompressedCache(model, **options))
    loaded = Context.load(context.save(tmp_path / "doc.kv"), model)
    question = "Which statement does nothing?"
    ids = torch.tensor([context.token_ids])
    _, logits = _follow_up(model, loaded.cache, ids, torch.tensor([loaded.question_ids(tokenizer, question)]), None, 8)
    in_place = Context.compress(model, tokenizer, document, CompressedCache(model, **options))
    _, expected = _follow_up(model, in_place.cache, ids, torch.tensor([in_place.question_ids(tokenizer, question)]),
                             None, 8)  # fmt: skip
    assert torch.equal(logits, expected)
    assert (tmp_path / "doc.kv").stat().st_size <= 0.11 * context.summary(model)["full_16bit_bytes"] + 64 * 1024


def test_weights_made_under_inference_mode_are_fingerprinted_and_offloaded_ones_are_named(tiny):
    _, tokenizer = tiny
    with torch.inference_mode():
        made = build_model(tokenizer)
    reference = build_model(tokenizer)  # the same seed: the same weights
    assert persist.weights_fingerprint(made) == persist.weights_fingerprint(reference)
    with torch.device("meta"):
        offloaded = build_model(tokenizer)
    with pytest.raises(ValueError, match="is on the meta device, offloaded"):
        persist.weights_fingerprint(offloaded)
