"""The compressed cache's C++ operators on a CPU: a decoding step's attention and the coding of entries.

- ``step_attention``: the CPU counterpart of ``_triton_attention.py``, with the same contract. Per (row, KV head),
  the stored keys are decoded eight at a time into a block and dotted with the query heads of their group, and the
  values likewise decoded and added times their probabilities (with AVX2 where the CPU has it and entries hold a
  multiple of eight channels), the residual window's tokens read exact: a step never writes a dense copy of the
  entries and launches one operator, ``torch.ops.decodekit.step_attention``, where decoding then attending launches
  dozens.
- ``encode``: ``Quantizer``'s coding of entries (scales rounded up and offsets down in the stored dtype, codes
  packed), equal to the PyTorch code's bytes, in one operator where that launches about twenty.
- ``append_coded``: a decoding step's key and value coded straight into the slots after each segment's entries.
- ``copy_rows`` and ``write_rows``: a storage's moves and writes of entries, every field at once (one operator where
  an ``index_copy_`` per field launches one to two a field); ``decay_add``: scores decayed and added to in place;
  ``evict_one``: an eviction of one entry a segment (its priority, its victim, the last entry moved into its slot).

The source (``native/cache_ops.cpp``) is built with PyTorch's C++ extension tools the first time it is needed (about
half a minute; a C++ compiler and ninja are needed) and kept in PyTorch's extensions folder (``TORCH_EXTENSIONS_DIR``,
under a name of its source text's: ``extension_name``) for later processes. Where it cannot be built, or with
``DECODEKIT_NATIVE=0`` in the environment when they are first asked for, PyTorch does the same work instead
(``available()`` says which).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native") / "cache_ops.cpp"
_LOCK = threading.Lock()
_BUILT: list[bool] = []  # whether the operators were built, once tried


def available() -> bool:
    """Whether the C++ operators run on a CPU (built now if they were not yet).

    Example:
        >>> isinstance(available(), bool)
        True
    """
    if not _BUILT:  # (asked at every step: the lock only until the first build was tried)
        with _LOCK:
            if not _BUILT:
                _BUILT.append(os.environ.get("DECODEKIT_NATIVE", "1") != "0" and _build())
    return _BUILT[0]


def _build() -> bool:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # (the ninja package's own binary, where the environment's bin is not on PATH)
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    logging.getLogger("decodekit").info("decodekit: building the cache's CPU operators (once, about half a minute)")
    try:
        cpp_extension.load(name=extension_name(), sources=[str(SOURCE)], is_python_module=False,
                           extra_cflags=["-O3", "-fopenmp-simd", "-fno-math-errno"], verbose=False)  # fmt: skip
        return True
    except Exception as error:  # (no compiler, no ninja, a failed build: PyTorch decoding takes over)
        logging.getLogger("decodekit").warning(
            "decodekit: the cache's CPU operators could not be built (%s); PyTorch decodes and codes entries "
            "instead, more slowly", str(error).splitlines()[0] if str(error) else type(error).__name__,
        )  # fmt: skip
        return False


def extension_name() -> str:
    """The operators' build name: one per source text, so that processes running other versions of decodekit never
    load each other's build from the shared extensions folder.

    Example:
        >>> extension_name().startswith("decodekit_cache_ops_")
        True
    """
    return "decodekit_cache_ops_" + hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]


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
    residual: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    key_means: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_triton_attention.step_attention`` on a CPU: the same arguments, the same results (the output ``[batch, 1,
    heads, head_dim]`` in the query's dtype, each slot's probability summed over its KV head's query heads); and a
    ``residual`` window: its exact keys (as attention reads them) and values ``[batch, heads, ring, head_dim]`` (in
    the scales' dtype) and their positions ``[ring]`` (int32), read instead of the codes of the tokens it holds.
    ``key_means``: smoothed keys' mean per row and KV head, float32 ``[batch, heads, 1, head_dim]``, added to each
    key decoded from its codes."""
    if not available():
        raise RuntimeError("the cache's CPU operators are not available (see _native.available())")
    key_codes, key_scales, key_offsets, key_bits = _part(storage, "keys", widths[0])
    value_codes, value_scales, value_offsets, value_bits = _part(storage, "values", widths[1])
    biases = _float32(storage.flat["biases"]) if biased else None
    positions = storage.flat["positions"] if window is not None or residual is not None else None
    ring_keys, ring_values, ring_positions = (None, None, None) if residual is None else residual
    output, received = torch.ops.decodekit.step_attention(
        _float32(query), key_codes, key_scales, key_offsets, key_bits, value_codes, value_scales, value_offsets,
        value_bits, group_size, storage.starts, storage.lengths, _float32(own_keys), _float32(own_values), biases,
        positions, storage.length_range[1], scaling, softcap or 0.0, query_position, window or 0, ring_keys,
        ring_values, ring_positions, None if key_means is None else key_means.contiguous(),
    )  # fmt: skip
    return (output if query.dtype == torch.float32 else output.to(query.dtype)), received


def _float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 and contiguous (itself where it is: no operator launched)."""
    return (tensor if tensor.dtype == torch.float32 else tensor.float()).contiguous()


def encode(values: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``values`` (float32 ``[..., head_dim]``, rotated already where coded rotated) coded in ``bits`` per channel in
    groups of ``group_size``: ``codes`` (uint8, packed), ``scales`` and ``offsets`` in ``dtype``, byte for byte what
    ``Quantizer`` codes in PyTorch."""
    codes, scales, offsets = torch.ops.decodekit.encode_entries(_float32(values), bits, group_size, dtype)
    return {"codes": codes, "scales": scales, "offsets": offsets}


def encodes(values: torch.Tensor) -> bool:
    """Whether ``encode`` codes ``values``: on a CPU, outside ``torch.compile``, where the operators are built."""
    return runs_on(values.device)


def runs_on(device: torch.device) -> bool:
    """Whether the operators run for tensors on ``device``: a CPU, outside ``torch.compile``, where they are built."""
    return device.type == "cpu" and not torch.compiler.is_compiling() and available()


def copy_rows(tensors: list[torch.Tensor], source: torch.Tensor, target: torch.Tensor) -> None:
    """In each of ``tensors`` (contiguous, ``[slots, ...]``), copy the rows ``source`` to the rows ``target`` (1-d
    indices of one size), all read before any is written."""
    torch.ops.decodekit.copy_rows(tensors, _int64(source), _int64(target))


def write_rows(tensors: list[torch.Tensor], index: torch.Tensor, values: list[torch.Tensor]) -> None:
    """In each of ``tensors``, write the rows of the matching ``values`` (``[len(index), ...]``, its dtype) at the
    rows ``index``."""
    torch.ops.decodekit.write_rows(tensors, _int64(index), [value.contiguous() for value in values])


def _int64(index: torch.Tensor) -> torch.Tensor:
    return (index if index.dtype == torch.int64 else index.long()).contiguous()


def decay_add(
    flat: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, added: torch.Tensor, decay: float
) -> None:
    """In ``flat`` (a float32 field), each segment's first slots (up to ``added.shape[-1]`` and its length) times
    ``decay`` plus ``added`` (``[batch, heads, stop]``), in place."""
    torch.ops.decodekit.decay_add(flat, starts, lengths, _float32(added), float(decay))


def move_in_segments(
    tensors: list[torch.Tensor], starts: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor,
    lanes: torch.Tensor | None,
) -> None:
    """In each of ``tensors``, within each segment (from ``starts``, ``[batch, heads]``), copy the slots ``sources`` to
    ``targets`` (``[batch, heads, n]``), only where ``lanes`` (bool, the same shape) when given, all read before any
    is written."""
    torch.ops.decodekit.move_in_segments(tensors, starts, _int64(sources), _int64(targets),
                                         None if lanes is None else lanes.contiguous())  # fmt: skip


def append_rows(
    tensors: list[torch.Tensor], values: list[torch.Tensor], zeroed: list[torch.Tensor], starts: torch.Tensor,
    lengths: torch.Tensor, count: int,
) -> None:
    """Write each of ``values`` (``[batch, heads, count, ...]``, its tensor's dtype) into the matching of ``tensors``
    after each segment's entries (from ``starts`` and ``lengths``), and zero those slots of ``zeroed``."""
    torch.ops.decodekit.append_rows(tensors, [value.contiguous() for value in values], zeroed, starts, lengths, count)


def append_coded(
    coded: list[torch.Tensor], rows: list[torch.Tensor], bits: list[int], group_size: int, positions: torch.Tensor,
    position: int, written: list[torch.Tensor], values: list[torch.Tensor], zeroed: list[torch.Tensor],
    starts: torch.Tensor, lengths: torch.Tensor, capacities: torch.Tensor,
) -> None:
    """One decoding step's entry after each segment's entries, coded: each of ``rows`` (float32 ``[batch, heads, 1,
    head_dim]``, keys rotated already) in its ``bits`` into the next three of ``coded`` (codes, scales, offsets), as
    ``encode`` codes it; ``positions`` set to ``position`` there, each of ``written`` given the row of the matching
    ``values`` (``[batch, heads, 1, ...]``, its dtype) and those slots of ``zeroed`` zeroed; refused (RuntimeError)
    where a segment's length reaches its ``capacities`` (int64 ``[batch, heads]``)."""
    torch.ops.decodekit.append_coded(coded, [_float32(part) for part in rows], bits, group_size, positions, position,
                                     written, [value.contiguous() for value in values], zeroed, starts, lengths,
                                     capacities)  # fmt: skip


def copy_segments(
    sources: list[torch.Tensor], targets: list[torch.Tensor], old_starts: torch.Tensor, segments: torch.Tensor,
    new_starts: torch.Tensor, lengths: torch.Tensor,
) -> None:
    """A storage laid out again: for each field's old and new tensor, each new segment's ``lengths`` entries copied as
    one block from the old segment ``segments`` (a flat index into ``old_starts``) to ``new_starts``."""
    torch.ops.decodekit.copy_segments(sources, targets, old_starts.contiguous(), _int64(segments),
                                      new_starts.contiguous(), lengths.contiguous())  # fmt: skip


def evict_one(
    fields: list[torch.Tensor], scores: torch.Tensor, value_norms: torch.Tensor | None, positions: torch.Tensor,
    starts: torch.Tensor, lengths: torch.Tensor, drops: torch.Tensor, seen: int, sink_tokens: int,
    recent_tokens: int, pads: torch.Tensor | None, window: int, protected_rank: float,
) -> None:
    """Evict the lowest-priority entry of each segment whose ``drops`` is 1 (``eviction.protect``'s priority, from
    ``scores`` times ``value_norms``), moving the segment's last entry into its slot in every field."""
    torch.ops.decodekit.evict_one(fields, scores, value_norms, positions, starts, lengths, _int64(drops), seen,
                                  sink_tokens, recent_tokens, None if pads is None else _int64(pads), window,
                                  protected_rank)  # fmt: skip
