"""Parameters that are one number, or one number per batch row (per request).

A per-row tensor may have one value per row of the scores, or one per request when generate has
expanded each request into several consecutive rows (``num_beams``, ``num_return_sequences``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from decodekit._validation import as_real, interval
from decodekit.settings import TEMPERATURE_RANGE

Number = float | int
RowValues = Number | Sequence[Number] | torch.Tensor
FLOAT32_MIN = float(torch.finfo(torch.float32).min)
__all__ = ["TEMPERATURE_RANGE", "RowParameter", "check_scores", "expand_rows", "integer_rows"]


def check_scores(scores: torch.Tensor, owner: str) -> tuple[int, int]:
    """``scores``' (rows, vocab), or a ValueError saying that ``owner`` needs ``[batch, vocab]`` scores.

    Example:
        >>> check_scores(torch.zeros(2, 5), "MinPLogitsProcessor")
        (2, 5)
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"{owner}: scores must be a [batch, vocab] tensor; got {shape}")
    return scores.shape[0], scores.shape[1]


def keep_bound(values: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """+inf where ``values >= threshold`` and -inf below it, by float arithmetic (a boolean mask
    costs more on CPU); ``minimum(scores, bound)`` then keeps scores bit for bit and removes the rest.

    IEEE subtraction gives +0 for equal operands, so the sign bit of ``values - threshold`` is set
    exactly where a value is below the threshold, once a +0 threshold is made -0 (else a -0 value
    equal to it would give -0). Copying that sign onto infinity gives the bound.

    Example:
        >>> keep_bound(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[2.0]])).tolist()
        [[-inf, inf, inf]]
    """
    bound = values - torch.where(threshold == 0, -0.0, threshold)
    return torch.copysign(torch.full((), math.inf, device=bound.device), bound, out=bound)


def check_filter_value(value: object) -> float:
    """``filter_value`` as a float (any number but NaN; usually -inf), or ValueError naming it."""
    number = as_real(value)
    if number is None or math.isnan(number):
        raise ValueError(f"filter_value must be a number (usually -inf); got {value!r}")
    return number


def fast_logsumexp(values: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` over the last dimension, kept ``[rows, 1]``, that stays fast when most entries
    are -inf (a filtered row): on CPU, ``exp`` of -inf takes a slow path, about 8x the time. Terms
    more than 80 below the maximum (each under 2e-35 of it) are clamped to that, which changes no
    float32 result.

    Example:
        >>> fast_logsumexp(torch.tensor([[0.0, 0.0, float("-inf")]])).item() == torch.log(torch.tensor(2.0)).item()
        True
    """
    top = values.amax(dim=-1, keepdim=True).clamp(min=FLOAT32_MIN)
    return (values - top).clamp_(min=-80.0).exp_().sum(dim=-1, keepdim=True).log_() + top


class RowParameter:
    """A validated scalar or 1-D tensor, handed out per call on the scores' device and dtype.

    Example:
        >>> p = RowParameter("min_p", [0.1, 0.2], low=0.0, high=1.0)
        >>> p.for_rows(4, torch.device("cpu"), torch.float32).flatten().tolist()
        [0.10000000149011612, 0.10000000149011612, 0.20000000298023224, 0.20000000298023224]
    """

    def __init__(
        self, name: str, value: RowValues, *, low: float, high: float, low_open: bool = False, high_open: bool = False
    ) -> None:
        self.name = name
        span = interval(low, high, low_open=low_open, high_open=high_open)
        scalar = as_real(value)
        if isinstance(value, bool) or _holds_bools(value):
            raise TypeError(f"{name} must be a number or a 1-D tensor of numbers {span}; got {value!r}")
        if scalar is not None:
            self.scalar: float | None = scalar
            values = torch.tensor([scalar], dtype=torch.float64)
        else:
            try:
                values = torch.as_tensor(value, dtype=torch.float64)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(f"{name} must be a number or a 1-D tensor of numbers; got {value!r}") from None
            if values.dim() != 1 or values.numel() == 0:
                raise ValueError(
                    f"{name} as a tensor must be 1-D with one value per batch row; got shape {tuple(values.shape)}"
                )
            self.scalar = None
        below = values <= low if low_open else values < low
        above = values >= high if high_open else values > high
        if not torch.isfinite(values).all() or below.any() or above.any():
            shown = self.scalar if self.scalar is not None else values.tolist()
            raise ValueError(f"{name} must be {span}; got {shown}")
        self.values = values
        self._cache: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

    def __repr__(self) -> str:
        return repr(self.scalar) if self.scalar is not None else f"tensor({self.values.tolist()})"

    @property
    def is_scalar(self) -> bool:
        return self.scalar is not None

    def for_rows(self, rows: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A ``[rows, 1]`` tensor of this parameter (a scalar broadcasts; a per-request tensor repeats)."""
        key = (rows, device, dtype)
        if key not in self._cache:
            self._cache[key] = expand_rows(self.values, rows, self.name).to(device=device, dtype=dtype)[:, None]
        return self._cache[key]


def _holds_bools(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    return isinstance(value, Sequence) and not isinstance(value, str) and any(isinstance(v, bool) for v in value)


def expand_rows(values: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """Repeat per-request ``values`` to ``rows`` rows, or raise ValueError naming ``name``."""
    count = values.shape[0]
    if count == 1 or count == rows:
        return values.expand(rows, *values.shape[1:]) if count == 1 else values
    if rows % count == 0:
        return values.repeat_interleave(rows // count, dim=0)
    raise ValueError(
        f"{name} has {count} per-row values but the scores have {rows} rows: give one value per row, "
        "or one per request when each request spans the same number of rows (beams, return sequences)"
    )


def integer_rows(name: str, values: Sequence[int] | torch.Tensor, *, minimum: int | None = None) -> torch.Tensor:
    """``values`` as a 1-D int64 tensor (one per batch row, or per request), or ValueError naming ``name``.

    Example:
        >>> integer_rows("seeds", [3, 4]).tolist()
        [3, 4]
    """
    try:
        tensor = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError):
        tensor = None
    valid = (
        tensor is not None
        and tensor.dim() == 1
        and tensor.numel() > 0
        and not tensor.is_floating_point()
        and tensor.dtype != torch.bool
        and (minimum is None or not bool((tensor < minimum).any()))
    )
    if not valid:
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(
            f"{name} must be a 1-D sequence of integers{bound}, one per batch row (or per request); got {values!r}"
        )
    return tensor.to(torch.int64)
