"""Adaptive-P: draw tokens near a target probability, adapting the target to what was drawn before."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import LogitsProcessor

from decodekit.logits_processors._rows import TEMPERATURE_RANGE, RowParameter, RowValues, check_scores
from decodekit.settings import ADAPTIVE_P_DECAY_RANGE

WIDTH = 0.3  # how far from the target a probability still counts as near it
PEAK = 5.0  # the new logit of a token exactly at the target
SHARPNESS = 10.0  # how fast new logits fall with the distance from the target


class AdaptivePLogitsProcessor(LogitsProcessor):
    r"""Adaptive-P (llama.cpp's ``adaptive-p`` sampler, PR #17927).

    Instead of removing tokens, it replaces each candidate's logit by a function of how far its
    probability ``p`` (at the temperature it is sampled at) lies from an adapted target ``a``:
    ``5 - 10 d^2 / (1 + d)`` with ``d = |p - a| / 0.3``, quadratic near the target and linear in the
    tails, so that the draw favours tokens near ``a``. The adapted target is
    ``clamp(2 * target - average, 0, 1)``, the average being the exponentially weighted mean (weight
    ``decay`` per step) of the probabilities the drawn tokens had, started as if the target had been
    met; a run of likely tokens lowers the next target. Tokens an earlier filter removed stay removed
    (put min-p before it as a guardrail, as llama.cpp advises).

    The state, one average per row, lives on the scores' device and follows the token generate
    appended to ``input_ids``, without a host sync; a new generation (another prompt length or
    number of rows) starts over. The new logits are multiplied by the temperature, which generate
    divides them by after user processors, so that tokens are drawn from the transformed logits as
    llama.cpp draws them. Under beam search a row's state would follow the wrong hypothesis, so
    ``Strategy`` refuses it with ``num_beams``.

    Args:
        target: the probability to aim for, in [0, 1]; one value or one per row (or request).
        decay: the weight of the past in the average, in [0, 0.99] (default 0.9).
        temperature: the temperature the probabilities are judged at (and that generate applies), per row or one.

    Example:
        >>> import torch
        >>> adaptive = AdaptivePLogitsProcessor(0.3)  # the first step aims at 0.3 itself
        >>> scores = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
        >>> adaptive(torch.zeros(1, 3, dtype=torch.long), scores).softmax(-1).argmax().item()  # 0.3 is favoured
        1
    """

    supports_continuous_batching = False

    def __init__(self, target: RowValues, decay: RowValues = 0.9, *, temperature: RowValues = 1.0) -> None:
        self.target = RowParameter("adaptive_p", target, low=0.0, high=1.0)
        self.decay = RowParameter(
            "adaptive_p_decay", decay, low=ADAPTIVE_P_DECAY_RANGE[0], high=ADAPTIVE_P_DECAY_RANGE[1]
        )
        self.temperature = RowParameter("temperature", temperature, low=TEMPERATURE_RANGE[0], high=TEMPERATURE_RANGE[1])
        self.weighted_sum: torch.Tensor | None = None  # [rows, 1]: sum of drawn probabilities times decay^age
        self.total_weight: torch.Tensor | None = None  # [rows, 1]: sum of decay^age
        self._probabilities: torch.Tensor | None = None  # last step's probabilities, before the transform
        self._length = -1  # input_ids length at the last call

    def reset(self) -> None:
        """Forget the state: the next call starts a new generation."""
        self.weighted_sum = self.total_weight = self._probabilities = None
        self._length = -1

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, _ = check_scores(scores, "AdaptivePLogitsProcessor")
        device = scores.device
        target = self.target.for_rows(rows, device, torch.float32)
        decay = self.decay.for_rows(rows, device, torch.float32)
        continues = (
            self.weighted_sum is not None
            and self.weighted_sum.shape[0] == rows
            and input_ids.shape[1] == self._length + 1
        )  # fmt: skip  (host-side shapes only)
        if continues:
            drawn = self._probabilities.gather(1, input_ids[:, -1:].to(device))
            self.weighted_sum = drawn + decay * self.weighted_sum
            self.total_weight = 1.0 + decay * self.total_weight
        else:  # as if the target had been met so far
            self.weighted_sum, self.total_weight = target / (1.0 - decay), 1.0 / (1.0 - decay)
        self._length = input_ids.shape[1]
        temperature = self.temperature.for_rows(rows, device, torch.float32)
        probabilities = torch.softmax(scores.float() / temperature, dim=-1)
        self._probabilities = probabilities
        adapted = (2.0 * target - self.weighted_sum / self.total_weight).clamp(0.0, 1.0)
        distance = (probabilities - adapted).abs() / WIDTH
        logits = PEAK - SHARPNESS * distance.square() / (1.0 + distance)
        logits = torch.where(torch.isneginf(scores), -torch.inf, logits)
        return (logits * temperature).to(scores.dtype)


def from_strategy(values: Mapping[str, Any], context: Any) -> AdaptivePLogitsProcessor:
    """The processor for a Strategy's ``adaptive_p`` and ``adaptive_p_decay`` (0.9 by default)."""
    return AdaptivePLogitsProcessor(
        values["adaptive_p"], values.get("adaptive_p_decay", 0.9), temperature=context.temperature
    )
