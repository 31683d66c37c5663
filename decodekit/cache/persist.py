"""A compressed cache to and from one file: compress a document once, ask about it many times.

The file is safetensors (no pickle): every layer's storage as it is held (codes where coded), its residual window,
padding and shares, and a JSON header with what the file needs to be used safely: the format's version, the model's
identity (its type, the shape of its attention, and a fingerprint of its weights that another checkpoint of the same
shape does not match), the dtype, the cache's options, each layer's numbers, and the token ids the cache holds when
the caller gave them. ``load`` refuses a file that does not fit, with one line naming what does not match.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

FORMAT = "decodekit-kv-cache"
VERSION = 1
# The config fields a saved cache depends on: the attention's shape and the positions' embedding.
IDENTITY_FIELDS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "sliding_window", "layer_types", "rope_theta", "rope_scaling", "rope_parameters",
    "partial_rotary_factor", "query_pre_attn_scalar", "attn_logit_softcapping",
)  # fmt: skip
FINGERPRINT_SAMPLES = 64  # values read from each parameter for the weights' fingerprint


def model_identity(model: nn.Module) -> dict:
    """What a saved cache must match of ``model``: its attention's config fields and its weights' fingerprint (a
    hash of ``FINGERPRINT_SAMPLES`` evenly spread values of every parameter, in float32)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    fields = {name: _plain(getattr(config, name, None)) for name in IDENTITY_FIELDS}
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            flat = parameter.detach().reshape(-1)
            index = torch.linspace(0, flat.numel() - 1, min(FINGERPRINT_SAMPLES, flat.numel())).long()
            digest.update(name.encode())
            digest.update(flat[index.to(flat.device)].float().cpu().numpy().tobytes())
    return {"config": fields, "weights": digest.hexdigest()}


def _plain(value):
    """A config value as JSON holds it (dicts and lists kept; anything else as its text)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return str(value)


def save(cache, path: str | os.PathLike, model: nn.Module, token_ids: list[int] | None = None) -> Path:
    """Write ``cache`` (bound to ``model``) to ``path``, atomically: into a temporary file beside it, renamed over
    ``path`` once complete, so that a save stopped midway leaves no partial file. Returns the path."""
    path = Path(path)
    tensors, layers = {}, []
    for index, layer in enumerate(cache.layers):
        held, numbers = layer.state()
        tensors.update({f"layers.{index}.{name}": tensor.detach().contiguous().cpu() for name, tensor in held.items()})
        layers.append(numbers)
    header = {
        "format": FORMAT, "version": VERSION, "model": model_identity(model), "dtype": layers[0]["dtype"],
        "options": {name: asdict(getattr(cache.options, name)) for name in ("size", "scoring", "storage", "replay")},
        "layers": layers, "token_ids": None if token_ids is None else [int(token) for token in token_ids],
        "memory_bytes": cache.memory_bytes(),
    }  # fmt: skip
    temporary = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        save_file(tensors, temporary, metadata={"decodekit": json.dumps(header)})
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def read_header(path: str | os.PathLike) -> dict:
    """The JSON header of a saved cache; ValueError naming the file when it is no readable decodekit cache file."""
    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except Exception as error:  # truncated, corrupted, or not safetensors at all
        raise ValueError(f"{path} is not a readable decodekit cache file ({type(error).__name__}: {error})") from None
    try:
        header = json.loads(metadata["decodekit"])
    except (KeyError, json.JSONDecodeError):
        raise ValueError(f"{path} is not a decodekit cache file (no decodekit header)") from None
    if header.get("format") != FORMAT:
        raise ValueError(f"{path} is not a decodekit cache file (format {header.get('format')!r})")
    if not isinstance(header.get("version"), int) or header["version"] > VERSION:
        raise ValueError(
            f"{path} was written in format version {header.get('version')}; this decodekit reads up to {VERSION}: "
            "upgrade decodekit"
        )
    return header


def check_fits(header: dict, model: nn.Module, path) -> None:
    """Refuse, in one line, a saved cache made for another model, checkpoint or dtype."""
    identity = model_identity(model)
    saved = header["model"]
    for name in IDENTITY_FIELDS:
        if saved["config"].get(name) != identity["config"].get(name):
            raise ValueError(
                f"{path} was saved for another model: config {name} is {saved['config'].get(name)!r} there and "
                f"{identity['config'].get(name)!r} here"
            )
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if header["dtype"] != dtype:
        raise ValueError(f"{path} was saved from a {header['dtype']} model; this one is {dtype}: load it in that dtype")
    if saved["weights"] != identity["weights"]:
        raise ValueError(f"{path} was saved for another checkpoint of this architecture (the weights' fingerprint "
                         "differs)")  # fmt: skip


def load(cache_class, path: str | os.PathLike, model: nn.Module, device: torch.device | str | None = None):
    """A cache of ``cache_class`` rebuilt from ``path`` and bound to ``model`` (on ``device``, default the model's)."""
    from decodekit.cache.options import ReplayOptions, ScoringOptions, SizeOptions, StorageOptions

    header = read_header(path)
    check_fits(header, model, path)
    options = header["options"]
    replay = dict(options["replay"], prefix=tuple(options["replay"]["prefix"]))
    cache = cache_class(
        model, size=SizeOptions(**options["size"]), scoring=ScoringOptions(**options["scoring"]),
        storage=StorageOptions(**options["storage"]), replay=ReplayOptions(**replay),
    )  # fmt: skip
    if len(header["layers"]) != len(cache.layers):
        raise ValueError(f"{path} holds {len(header['layers'])} layers; the model has {len(cache.layers)}")
    device = device or next(model.parameters()).device
    try:
        with safe_open(str(path), framework="pt") as file:
            for index, (layer, numbers) in enumerate(zip(cache.layers, header["layers"], strict=True)):
                prefix = f"layers.{index}."
                names = [name for name in file.keys() if name.startswith(prefix)]  # noqa: SIM118 (no iteration)
                tensors = {name.removeprefix(prefix): file.get_tensor(name) for name in names}
                layer.restore(tensors, numbers, device)
    except ValueError:
        raise
    except Exception as error:
        raise ValueError(f"{path} is not a readable decodekit cache file ({type(error).__name__}: {error})") from None
    cache.token_ids = header["token_ids"]
    return cache
