"""Strategy: one named decoding recipe, turned into the keyword arguments of ``model.generate``.

The CLI, the demo and the evaluation runner all build their generate calls from a Strategy, so
each recipe is written once. A Strategy states the whole recipe: a filter it does not name is
off, whatever defaults the model's ``generation_config`` carries (transformers would otherwise
apply top-k 50 to every sampling call).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any


def _check_positive_finite(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0; got {value!r}")


@dataclass(frozen=True)
class Strategy:
    """A decoding recipe: greedy, or sampling with temperature / top-k / top-p.

    Args:
        name: a label for reports and the demo; derived from the fields when omitted.
        do_sample: sample instead of taking the most likely token. None (the default) means
            "sample when any sampling field is set".
        temperature: divides the logits before sampling; > 0.
        top_k: keep only the k most likely tokens; >= 1.
        top_p: keep the smallest set of tokens whose probability reaches p; in (0, 1].

    Example:
        >>> from decodekit import Strategy
        >>> Strategy().generate_kwargs()
        {'do_sample': False}
        >>> Strategy(temperature=0.7, top_p=0.9).generate_kwargs()
        {'do_sample': True, 'temperature': 0.7, 'top_k': 0, 'top_p': 0.9}
        >>> Strategy(temperature=0.7, top_p=0.9).label
        'sample(temperature=0.7, top_p=0.9)'
    """

    name: str | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.do_sample is not None and not isinstance(self.do_sample, bool):
            raise TypeError(f"do_sample must be True, False or None; got {self.do_sample!r}")
        _check_positive_finite("temperature", self.temperature)
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
        ):
            raise ValueError(f"top_k must be an integer >= 1; got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p!r}")
        if self.do_sample is False and self._sampling_fields():
            names = ", ".join(self._sampling_fields())
            raise ValueError(f"{names} only apply when sampling: leave do_sample unset or set it to True")

    def _sampling_fields(self) -> list[str]:
        return [name for name in ("temperature", "top_k", "top_p") if getattr(self, name) is not None]

    @property
    def sampling(self) -> bool:
        """Whether this recipe samples (True) or decodes greedily (False)."""
        return self.do_sample if self.do_sample is not None else bool(self._sampling_fields())

    @property
    def label(self) -> str:
        """A short human-readable name: ``name`` if given, else one built from the fields."""
        if self.name:
            return self.name
        if not self.sampling:
            return "greedy"
        parts = [f"{field}={getattr(self, field)}" for field in self._sampling_fields()]
        return f"sample({', '.join(parts)})"

    def generate_kwargs(self, model: Any = None) -> dict[str, Any]:
        """The keyword arguments for ``model.generate`` that carry out this recipe.

        ``model`` is the model the call will run on; recipes that build per-call objects bound
        to a model (a compressed cache) need it.
        """
        kwargs: dict[str, Any] = {"do_sample": self.sampling}
        if self.sampling:
            kwargs["temperature"] = float(self.temperature if self.temperature is not None else 1.0)
            kwargs["top_k"] = self.top_k if self.top_k is not None else 0
            kwargs["top_p"] = float(self.top_p if self.top_p is not None else 1.0)
        return kwargs

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, for reports; ``Strategy(**s.to_dict())`` rebuilds it."""
        return {key: value for key, value in asdict(self).items() if value is not None}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Strategy:
        """Build a Strategy from a mapping, rejecting unknown keys by name."""
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown Strategy field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)
