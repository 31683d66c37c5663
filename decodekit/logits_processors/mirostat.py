"""Mirostat v2: truncate each step's distribution so that the text's surprise tracks a target."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import LogitsProcessor

from decodekit.logits_processors._rows import TEMPERATURE_RANGE, RowParameter, RowValues, check_scores, keep_bound
from decodekit.settings import MIROSTAT_ETA_RANGE, MIROSTAT_TAU_RANGE


class MirostatLogitsProcessor(LogitsProcessor):
    r"""Mirostat 2.0 (Basu et al., 2021, "Mirostat: a neural text decoding algorithm that directly
    controls perplexity"; the variant llama.cpp calls mirostat 2).

    Each row keeps a bound ``mu`` on surprise (in bits), starting at ``2 * tau``. At every step the
    tokens whose surprise ``-log2 p`` exceeds ``mu`` are removed (the most likely token always
    stays), the sampler draws from what remains, and at the next step ``mu`` moves by
    ``eta * (tau - s)``, where ``s`` is the surprise of the token drawn under the truncated,
    renormalized distribution. ``p`` is judged at ``temperature`` (the one you sample at).

    The state lives on the scores' device, one ``mu`` per row, and is updated without a host
    sync from the token that generate appended to ``input_ids``. A new generation (a prompt of
    another length, or another number of rows) starts from ``2 * tau`` again. Under greedy
    decoding the filter never removes the token chosen, so it changes nothing. Under beam search
    rows are reordered between steps and a row's ``mu`` would follow the wrong hypothesis, so
    ``Strategy`` refuses Mirostat with ``num_beams``; use it for sampling.

    Args:
        tau: the target surprise in bits, > 0 (llama.cpp's default is 5.0).
        eta: the learning rate of ``mu``, in (0, 1] (default 0.1).
        temperature: the temperature the probabilities are judged at; float or per row.

    Example:
        >>> import torch
        >>> mirostat = MirostatLogitsProcessor(tau=1.0)  # mu = 2 bits: keeps tokens with p >= 1/4
        >>> scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
        >>> mirostat(torch.zeros(1, 3, dtype=torch.long), scores).isfinite().tolist()
        [[True, True, False, False]]
    """

    supports_continuous_batching = False

    def __init__(self, tau: RowValues, eta: RowValues = 0.1, *, temperature: RowValues = 1.0) -> None:
        self.tau = RowParameter(
            "mirostat_tau", tau, low=MIROSTAT_TAU_RANGE[0], high=MIROSTAT_TAU_RANGE[1], low_open=True
        )
        self.eta = RowParameter(
            "mirostat_eta", eta, low=MIROSTAT_ETA_RANGE[0], high=MIROSTAT_ETA_RANGE[1], low_open=True
        )
        self.temperature = RowParameter("temperature", temperature, low=TEMPERATURE_RANGE[0], high=TEMPERATURE_RANGE[1])
        self.mu: torch.Tensor | None = None  # [rows, 1]: each row's surprise bound, in bits
        self._kept_log2: torch.Tensor | None = None  # last step's log2 probabilities
        self._log2_norm: torch.Tensor | None = None  # log2 of the kept tokens' total, to renormalize
        self._length = -1  # input_ids length at the last call

    def reset(self) -> None:
        """Forget the state: the next call starts a new generation."""
        self.mu, self._kept_log2, self._log2_norm, self._length = None, None, None, -1

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, _ = check_scores(scores, "MirostatLogitsProcessor")
        device = scores.device
        tau = self.tau.for_rows(rows, device, torch.float32)
        continues = (
            self.mu is not None and self.mu.shape[0] == rows and input_ids.shape[1] == self._length + 1
        )  # host-side shapes only
        if continues:
            drawn = input_ids[:, -1:].to(device)
            # The drawn token's surprise under last step's truncated, renormalized distribution.
            surprise = self._log2_norm - self._kept_log2.gather(1, drawn)
            self.mu = self.mu - self.eta.for_rows(rows, device, torch.float32) * (surprise - tau)
        else:
            self.mu = 2.0 * tau
        self._length = input_ids.shape[1]
        temperature = self.temperature.for_rows(rows, device, torch.float32)
        probabilities = torch.softmax(scores.float() / temperature, dim=-1)
        log2_p = torch.log2(probabilities)
        # Keep log2 p >= -mu, and always the best token.
        cut = torch.minimum(-self.mu, log2_p.amax(dim=-1, keepdim=True))
        bound = keep_bound(log2_p, cut)  # +inf to keep, -inf to remove
        kept_mass = torch.linalg.vecdot(probabilities, bound.clamp(min=0.0, max=1.0)).unsqueeze(-1)
        self._kept_log2, self._log2_norm = log2_p, torch.log2(kept_mass)  # drawn tokens are always kept ones
        return torch.minimum(scores, bound.to(scores.dtype))


def from_strategy(values: Mapping[str, Any], context: Any) -> MirostatLogitsProcessor:
    """The processor for a Strategy's ``mirostat_tau`` and ``mirostat_eta`` (0.1 by default)."""
    return MirostatLogitsProcessor(
        values["mirostat_tau"], values.get("mirostat_eta", 0.1), temperature=context.temperature
    )
