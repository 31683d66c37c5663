"""Length normalization: how a finished hypothesis's summed log-probability becomes its score.

Beam search compares hypotheses of different lengths. The raw sum S of token log-probabilities
favours short outputs (every token adds a negative term), so the score divides S by a function
of the length L (generated tokens, EOS included, prompt excluded) and may add a reward per token:

- ``"none"``: S
- ``"average"``: S / L**alpha (transformers' ``length_penalty``; alpha=1 is the mean log-prob)
- ``"gnmt"``: S / ((5 + L) / 6)**alpha (Wu et al. 2016, Google's NMT system)

plus ``reward * L`` when ``reward`` is set (Murray & Chiang 2018, "Correcting length bias").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decodekit._validation import check_real
from decodekit.settings import ALPHA_RANGE, NORMALIZATIONS, REWARD_RANGE

__all__ = ["ALPHA_RANGE", "NORMALIZATIONS", "REWARD_RANGE", "LengthNormalization"]


@dataclass(frozen=True)
class LengthNormalization:
    """A length normalization rule, applied to summed log-probabilities.

    Args:
        kind: ``"none"``, ``"average"`` or ``"gnmt"``.
        alpha: the exponent of the length term, in [0, 5] (ignored by ``"none"``).
        reward: added per generated token, in [0, 10].

    Example:
        >>> import torch
        >>> rule = LengthNormalization("gnmt", alpha=1.0)
        >>> rule.denominator(7)
        2.0
        >>> rule(torch.tensor([-4.0]), 7)
        tensor([-2.])
        >>> LengthNormalization("none", reward=0.5)(torch.tensor([-4.0]), 6)
        tensor([-1.])
    """

    kind: str = "average"
    alpha: float = 1.0
    reward: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in NORMALIZATIONS:
            raise ValueError(f"length_normalization must be one of {', '.join(NORMALIZATIONS)}; got {self.kind!r}")
        object.__setattr__(self, "alpha", check_real("length_alpha", self.alpha, *ALPHA_RANGE))
        object.__setattr__(self, "reward", check_real("length_reward", self.reward, *REWARD_RANGE))

    def denominator(self, length: int) -> float:
        """What the summed log-probability of a ``length``-token hypothesis is divided by."""
        if self.kind == "average":
            return float(length) ** self.alpha
        if self.kind == "gnmt":
            return ((5.0 + length) / 6.0) ** self.alpha
        return 1.0

    def __call__(self, log_prob_sum: torch.Tensor, length: int) -> torch.Tensor:
        """The scores of hypotheses of ``length`` tokens whose log-probabilities sum to ``log_prob_sum``."""
        score = log_prob_sum / self.denominator(length)
        if self.reward:
            score = score + self.reward * length
        return score

    @property
    def favours_length(self) -> bool:
        """Whether a longer hypothesis with the same (negative) sum scores higher."""
        return (self.kind != "none" and self.alpha > 0) or self.reward > 0
