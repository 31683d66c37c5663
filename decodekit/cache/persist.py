"""A compressed cache to and from one file: compress a document once, ask about it many times.

The file is safetensors (no pickle): every layer's storage as it is held (codes where coded), its residual window,
padding and shares, and a JSON header with what the file needs to be used safely: the format's version, the model's
identity (its type, the shape of its attention, and a fingerprint of all its weights, which another checkpoint of the
same shape does not match), the dtype, the cache's options, each layer's numbers, the token ids the cache holds when
the caller gave them, the caller's own notes (``metadata``), and a checksum of the header and every tensor, so that a
corrupted file is refused rather than read. ``load`` refuses a file that does not fit, with one line naming what
does not match.

The versions in ``READS`` are read: ``VERSION``, and version 1, written before coded keys were smoothed, which loads
with its keys coded whole (``smooth_keys=False``). A change to what a layer saves (``CompressedLayer.state``) changes
the format: raise ``VERSION`` with it (``tests/test_kv_reuse.py`` holds a file of each version read and checks that it
still loads and answers as the cache it was saved from).
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

FORMAT = "decodekit-kv-cache"
VERSION = 2
READS = (1, 2)  # the versions read (1: coded keys whole, without their mean keys)
# The config fields a saved cache depends on: the attention's shape and the positions' embedding.
IDENTITY_FIELDS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "sliding_window", "layer_types", "rope_theta", "rope_scaling", "rope_parameters",
    "partial_rotary_factor", "query_pre_attn_scalar", "attn_logit_softcapping",
)  # fmt: skip
HASH = "xxh3_128"  # of every byte of the weights (about 7 GB/s on one core) and of the file's contents
# Per model, the weights' fingerprint and what it was computed from (each parameter's address and version counter,
# which an in-place change advances), so that a process that saves or loads many caches hashes its weights once.
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _own_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the host, contiguous, in memory of its own (safetensors refuses tensors that share memory, as the
    slices of the layers' shared storage do)."""
    tensor = tensor.detach().contiguous().cpu()
    return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


def _tensor_bytes(tensor: torch.Tensor):
    """The bytes of ``tensor`` (on the host, contiguous) as a NumPy array of uint8, without a copy where it can."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def weights_fingerprint(model: nn.Module) -> str:
    """An ``xxh3_128`` hash of every parameter's name, shape, dtype and bytes: a different checkpoint of the same
    shape (one weight changed) does not match it. Computed once per model while its parameters stay as they are.

    Example:
        >>> a, b = nn.Linear(3, 2), nn.Linear(3, 2)
        >>> with torch.no_grad():
        ...     _ = b.load_state_dict(a.state_dict())
        ...     same = weights_fingerprint(a) == weights_fingerprint(b)
        ...     b.weight[1, 2] += 1e-3
        >>> same, weights_fingerprint(a) == weights_fingerprint(b)
        (True, False)
    """
    parameters = sorted(model.named_parameters())
    offloaded = [name for name, parameter in parameters if parameter.device.type == "meta"]
    if offloaded:
        raise ValueError(
            f"the model's weights are not all in memory ({offloaded[0]} is on the meta device, offloaded): a saved KV "
            "cache checks every weight; load the model without offloading"
        )
    try:
        key = tuple((name, parameter.data_ptr(), parameter._version) for name, parameter in parameters)
    except RuntimeError:  # weights made under torch.inference_mode keep no version counter: hash them every time
        key = None
    known = _FINGERPRINTS.get(model)
    if key is not None and known is not None and known[0] == key:
        return known[1]
    digest = xxhash.xxh3_128()
    with torch.no_grad():
        for name, parameter in parameters:
            digest.update(f"{name} {tuple(parameter.shape)} {parameter.dtype}\n".encode())
            digest.update(_tensor_bytes(parameter))
    fingerprint = digest.hexdigest()
    if key is not None:
        _FINGERPRINTS[model] = (key, fingerprint)
    return fingerprint


def model_identity(model: nn.Module) -> dict:
    """What a saved cache must match of ``model``: its attention's config fields and its weights' fingerprint
    (``weights_fingerprint``).

    Example (with ``model`` from ``load_model``)::

        identity = model_identity(model)
        print(identity["config"]["num_key_value_heads"], identity["weights"])
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    fields = {name: _plain(getattr(config, name, None)) for name in IDENTITY_FIELDS}
    return {"config": fields, "weights": {HASH: weights_fingerprint(model)}}


def _plain(value):
    """A config value as JSON holds it (dicts and lists kept; anything else as its text)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return str(value)


def _checksum(header: dict, tensors: Mapping[str, torch.Tensor]) -> str:
    """``xxh3_128`` of the header (without its checksum) and of every tensor's name, dtype, shape and bytes."""
    described = json.dumps({k: v for k, v in header.items() if k != "checksum"}, sort_keys=True)
    digest = xxhash.xxh3_128(described.encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()


def token_rows(token_ids, rows: int, seen: int) -> list[int] | list[list[int]]:
    """``token_ids`` as the header holds them: one list for one row, a list per row for several (a tensor or nested
    lists of ``[rows, seen]``); ValueError unless each row holds ``seen`` tokens, padding included.

    Example:
        >>> token_rows(torch.tensor([[5, 6, 7]]), rows=1, seen=3), token_rows([[0, 5], [6, 7]], rows=2, seen=2)
        ([5, 6, 7], [[0, 5], [6, 7]])
        >>> token_rows([5, 6], rows=1, seen=3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: token_ids holds 2 tokens per row; the cache has seen 3 (padding included): pass every token...
    """
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    if not isinstance(token_ids, Sequence) or isinstance(token_ids, str):
        raise TypeError(f"token_ids must be a list of token ids (one per row for several rows); got {token_ids!r:.80}")
    nested = len(token_ids) > 0 and not isinstance(token_ids[0], int)
    table = [list(row) for row in token_ids] if nested else [list(token_ids)]
    if len(table) != rows:
        raise ValueError(f"token_ids holds {len(table)} row(s); the cache holds {rows}: give one list per row")
    for row in table:
        if not all(isinstance(token, int) and not isinstance(token, bool) for token in row):
            raise TypeError("token_ids must hold integers (token ids)")
        if len(row) != seen:
            raise ValueError(
                f"token_ids holds {len(row)} tokens per row; the cache has seen {seen} (padding included): pass every "
                "token it was given"
            )
    return table[0] if rows == 1 else table


def save(
    cache,
    path: str | os.PathLike,
    model: nn.Module,
    token_ids=None,
    metadata: Mapping | None = None,
) -> Path:
    """Write ``cache`` (bound to ``model``) to ``path``, atomically: into a temporary file beside it, flushed to the
    disk and renamed over ``path`` once complete, so that a save stopped midway (an error, Ctrl-C, the process
    killed) leaves no partial file at ``path``. A temporary left by a killed save is removed by the next save to the
    same path. ``token_ids`` (checked against the tokens seen) and ``metadata`` (JSON) go into the header. Returns the
    path.

    Example (with a filled ``cache`` and its ``model``; ``CompressedCache.save`` calls it)::

        save(cache, "doc.kv", model, token_ids=ids[0].tolist(), metadata={"source": "report.txt"})
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder: give a file name to save the cache to")
    if not path.parent.is_dir():
        raise ValueError(f"cannot save to {path}: the folder {path.parent} does not exist")
    tensors, layers = {}, []
    for index, layer in enumerate(cache.layers):
        held, numbers = layer.state()
        tensors.update({f"layers.{index}.{name}": _own_copy(tensor) for name, tensor in held.items()})
        layers.append(numbers)
    if token_ids is not None:
        token_ids = token_rows(token_ids, cache.layers[0].rows, cache.get_seq_length())
    if metadata is not None:
        metadata = json.loads(json.dumps(dict(metadata)))  # (refused here, not after the file is half written)
    header = {
        "format": FORMAT, "version": VERSION, "model": model_identity(model), "dtype": layers[0]["dtype"],
        "options": {name: asdict(getattr(cache.options, name)) for name in ("size", "scoring", "storage", "replay")},
        "layers": layers, "token_ids": token_ids, "metadata": metadata, "memory_bytes": cache.memory_bytes(),
    }  # fmt: skip
    header["checksum"] = {HASH: _checksum(header, tensors)}
    _remove_stale_temporaries(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        save_file(tensors, temporary, metadata={"decodekit": json.dumps(header)})
        os.chmod(temporary, 0o666 & ~_umask())  # (safetensors writes 0600: give it a new file's usual mode)
        with open(temporary, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    _sync_folder(path.parent)
    return path


def _remove_stale_temporaries(path: Path) -> None:
    """Remove the temporaries that saves to ``path`` killed midway left (their process is gone)."""
    for temporary in path.parent.glob(f".{path.name}.*.partial"):
        pid = temporary.name.removeprefix(f".{path.name}.").removesuffix(".partial")
        if pid.isdigit() and not _alive(int(pid)):
            temporary.unlink(missing_ok=True)


def _umask() -> int:
    """The process's umask, read without changing it (Linux); 0o022 where it cannot be read."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OSError:  # (a platform without signals: keep the file)
        return True
    return True


def _sync_folder(folder: Path) -> None:
    """Flush the folder's entry of a renamed file (where the platform can open a folder)."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def read_header(path: str | os.PathLike) -> dict:
    """The JSON header of a saved cache; ValueError naming the file when it is no readable decodekit cache file of
    this format's version.

    Example (with a file ``CompressedCache.save`` wrote)::

        header = read_header("doc.kv")
        print(header["token_ids"][:8], header["memory_bytes"], header["metadata"])
    """
    if Path(path).is_dir():
        raise ValueError(f"{path} is a folder, not a decodekit cache file")
    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except Exception as error:  # truncated, corrupted, or not safetensors at all
        raise ValueError(f"{path} is not a readable decodekit cache file ({_reason(error)})") from None
    try:
        header = json.loads(metadata["decodekit"])
    except (KeyError, json.JSONDecodeError):
        raise ValueError(f"{path} is not a decodekit cache file (no decodekit header)") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{path} is not a decodekit cache file (format {_get(header, 'format')!r})")
    version = header.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise ValueError(
            f"{path} was written in format version {version}; this decodekit reads version {VERSION}: upgrade decodekit"
        )
    if version not in READS:
        raise ValueError(
            f"{path} was written in format version {version}, which this decodekit no longer reads (it reads "
            f"{', '.join(map(str, READS))}): compress the document again"
        )
    return header


def _get(header, name: str):
    return header.get(name) if isinstance(header, dict) else None


def _reason(error: Exception) -> str:
    """An error's type and the first line of its message."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def check_fits(header: dict, model: nn.Module, path) -> None:
    """Refuse, in one line, a saved cache made for another model, checkpoint or dtype.

    Example (with ``model`` from ``load_model``)::

        check_fits(read_header("doc.kv"), model, "doc.kv")  # ValueError: ... saved for another checkpoint ...
    """
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
    if saved["weights"].get(HASH) != identity["weights"][HASH]:
        raise ValueError(f"{path} was saved for another checkpoint of this architecture (the weights' fingerprint "
                         "differs)")  # fmt: skip


def load(cache_class, path: str | os.PathLike, model: nn.Module, device: torch.device | str | None = None):
    """A cache of ``cache_class`` rebuilt from ``path`` and bound to ``model`` (on ``device``, default the model's).

    Example (with ``model`` from ``load_model``; ``CompressedCache.load`` calls it)::

        cache = load(CompressedCache, "doc.kv", model)
    """
    from decodekit.cache.options import ReplayOptions, ScoringOptions, SizeOptions, StorageOptions

    header = read_header(path)
    check_fits(header, model, path)
    try:
        with safe_open(str(path), framework="pt") as file:
            tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 (no iteration)
    except Exception as error:
        raise ValueError(f"{path} is not a readable decodekit cache file ({_reason(error)})") from None
    if header.get("checksum", {}).get(HASH) != _checksum(header, tensors):
        raise ValueError(f"{path} is corrupted: its contents do not match the checksum written with them")
    options = header["options"]
    if header["version"] == 1:  # (written before coded keys were smoothed)
        options["storage"].setdefault("smooth_keys", False)
    replay = dict(options["replay"], prefix=tuple(options["replay"]["prefix"]))
    cache = cache_class(
        model, size=SizeOptions(**options["size"]), scoring=ScoringOptions(**options["scoring"]),
        storage=StorageOptions(**options["storage"]), replay=ReplayOptions(**replay),
    )  # fmt: skip
    if len(header["layers"]) != len(cache.layers):
        raise ValueError(f"{path} holds {len(header['layers'])} layers; the model has {len(cache.layers)}")
    device = device or next(model.parameters()).device
    try:
        for index, (layer, numbers) in enumerate(zip(cache.layers, header["layers"], strict=True)):
            prefix = f"layers.{index}."
            held = {name.removeprefix(prefix): tensor for name, tensor in tensors.items() if name.startswith(prefix)}
            layer.restore(held, numbers, device)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    except Exception as error:
        raise ValueError(f"{path} is not a readable decodekit cache file ({_reason(error)})") from None
    cache.token_ids = header["token_ids"]
    return cache
