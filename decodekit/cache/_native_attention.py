"""A decoding step's attention over coded entries, read where they lie, on a CPU: one C++ operator per layer.

The CPU counterpart of ``_triton_attention.py``, with the same contract (``step_attention``): per (row, KV head), the
stored keys are decoded eight at a time into a block and dotted with the query heads of their group, and the values
likewise decoded and added times their probabilities (with AVX2 where the CPU has it and entries hold a multiple of 64
channels), so that a step never writes a dense copy of the entries and launches one operator,
``torch.ops.decodekit.step_attention``, where decoding then attending launches dozens. The source
(``native/step_attention.cpp``) is built with PyTorch's C++ extension tools the first time a step needs it (about half
a minute; a C++ compiler and ninja are needed) and kept in PyTorch's extensions folder (``TORCH_EXTENSIONS_DIR``) for
later processes. Where it cannot be built, or with
``DECODEKIT_NATIVE=0`` in the environment, steps decode the entries in PyTorch instead (``available()`` says which).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native") / "step_attention.cpp"
_LOCK = threading.Lock()
_BUILT: list[bool] = []  # whether the operator was built, once tried


def available() -> bool:
    """Whether steps on a CPU read their entries with the C++ operator (built now if it was not yet).

    Example:
        >>> isinstance(available(), bool)
        True
    """
    if os.environ.get("DECODEKIT_NATIVE", "1") == "0":
        return False
    with _LOCK:
        if not _BUILT:
            _BUILT.append(_build())
    return _BUILT[0]


def _build() -> bool:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # (the ninja package's own binary, where the environment's bin is not on PATH)
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    logging.getLogger("decodekit").info("decodekit: building the CPU attention operator (once, about half a minute)")
    try:
        cpp_extension.load(name="decodekit_step_attention", sources=[str(SOURCE)], is_python_module=False,
                           extra_cflags=["-O3", "-fopenmp-simd", "-fno-math-errno"], verbose=False)  # fmt: skip
        return True
    except Exception as error:  # (no compiler, no ninja, a failed build: PyTorch decoding takes over)
        logging.getLogger("decodekit").warning(
            "decodekit: the CPU attention operator could not be built (%s); decoding steps decode entries in "
            "PyTorch instead, more slowly", str(error).splitlines()[0] if str(error) else type(error).__name__,
        )  # fmt: skip
        return False


def _part(storage, part: str, bits: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A part's flat tensors for the operator: codes (or the plain entries), scales, offsets and its width (16 for a
    part stored as it is)."""
    codes = storage.flat[part]
    if bits is None:
        return codes, codes, codes, 16
    prefix = part[:-1]
    return codes, storage.flat[f"{prefix}_scales"], storage.flat[f"{prefix}_offsets"], bits


def step_attention(
    query: torch.Tensor,
    storage,
    widths: tuple[int | None, int | None],
    group_size: int,
    own_keys: torch.Tensor,
    own_values: torch.Tensor,
    scaling: float,
    *,
    softcap: float | None = None,
    biased: bool = False,
    window: int | None = None,
    query_position: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoding step's attention for ``query`` ``[batch, heads, 1, head_dim]`` over every entry each segment of
    ``storage`` stored before the step (its last entry is the step's own, read exact from ``own_keys`` and
    ``own_values``, ``[batch, kv_heads, 1, head_dim]``). ``widths``: the key and value bits (None: stored as they
    are); ``group_size``: channels per scale. Returns the output ``[batch, 1, heads, head_dim]`` in the query's dtype
    and each slot's probability summed over the query heads of its KV head, ``[batch, kv_heads, slots]`` (the step's
    own token at each segment's last slot), as ``_triton_attention.step_attention`` does."""
    if not available():
        raise RuntimeError("the CPU attention operator is not available (see _native_attention.available())")
    key_codes, key_scales, key_offsets, key_bits = _part(storage, "keys", widths[0])
    value_codes, value_scales, value_offsets, value_bits = _part(storage, "values", widths[1])
    biases = _float32(storage.flat["biases"]) if biased else None
    positions = storage.flat["positions"] if window is not None else None
    output, received = torch.ops.decodekit.step_attention(
        _float32(query), key_codes, key_scales, key_offsets, key_bits, value_codes, value_scales, value_offsets,
        value_bits, group_size, storage.starts, storage.lengths, _float32(own_keys), _float32(own_values), biases,
        positions, storage.length_range[1], scaling, softcap or 0.0, query_position, window or 0,
    )  # fmt: skip
    return (output if query.dtype == torch.float32 else output.to(query.dtype)), received


def _float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 and contiguous (itself where it is: no operator launched)."""
    return (tensor if tensor.dtype == torch.float32 else tensor.float()).contiguous()
