"""Sampling with one seed per row, so that a prompt draws the same tokens alone or in any batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor

from decodekit._validation import check_int
from decodekit.logits_processors._rows import check_scores, expand_rows, integer_rows

MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31, so that a 32-bit value times one never leaves int64.
MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39)
REPLICA_STRIDE = 0x3C6EF372  # separates the seeds of one request's return sequences


def _mix(values: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 tensors holding values below 2**32."""
    for multiplier in MULTIPLIERS:
        values = values ^ (values >> 16)
        values = (values * multiplier) & MASK32
    return values ^ (values >> 16)


def uniform_draws(seeds: torch.Tensor, step: int, device: torch.device, stream: int = 1) -> torch.Tensor:
    """``[rows]`` float32 uniform draws in (0, 1), a pure function of (seed, step, stream).

    ``stream`` separates independent uses of one seed (XTC's coin flips from sampling's noise).

    Example:
        >>> cpu = torch.device("cpu")
        >>> a = uniform_draws(torch.tensor([1, 2]), 3, cpu)
        >>> bool(((a > 0) & (a < 1)).all()), torch.equal(a[1:], uniform_draws(torch.tensor([2]), 3, cpu))
        (True, True)
    """
    key = _mix((seeds.to(device=device, dtype=torch.int64) & MASK32) ^ _mix(torch.tensor(step, device=device)))
    bits = _mix(key ^ _mix(torch.tensor(stream + MULTIPLIERS[1], device=device)))
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel_noise(seeds: torch.Tensor, step: int, vocab: int, device: torch.device) -> torch.Tensor:
    """``[rows, vocab]`` float32 Gumbel(0, 1) noise, a pure function of (seed, step, token).

    Example:
        >>> a = gumbel_noise(torch.tensor([1, 2]), 0, 5, torch.device("cpu"))
        >>> b = gumbel_noise(torch.tensor([2]), 0, 5, torch.device("cpu"))
        >>> torch.equal(a[1], b[0])
        True
    """
    key = _mix((seeds.to(device=device, dtype=torch.int64) & MASK32) ^ _mix(torch.tensor(step, device=device)))
    tokens = torch.arange(vocab, device=device, dtype=torch.int64)
    bits = _mix(key[:, None] ^ _mix(tokens + MULTIPLIERS[0]))
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1), 24 bits
    return -torch.log(-torch.log(uniform))


class GumbelSamplingLogitsProcessor(LogitsProcessor):
    r"""Sample with one seed per row: add seeded Gumbel noise, then let greedy decoding take the argmax.

    ``argmax(scores + G)`` with G standard Gumbel noise is a draw from ``softmax(scores)`` (the
    Gumbel-max trick). The noise is a hash of (row seed, step, token id), so a row's draws do not
    depend on the rows beside it, the batch size or the device's random state: a prompt samples
    the same text alone or in any batch. Put it last in the processor list, after the filters and
    the temperature, and generate with ``do_sample=False``; ``Strategy.generate_kwargs(...,
    row_seeds=...)`` builds that chain.

    Args:
        seeds: one integer seed per batch row, or per request when generate expands requests into
            several return sequences (each of those then gets its own stream); one seed alone is
            one request.
        prompt_length: the padded prompt's length; the step is the number of tokens generated since.

    Example:
        >>> import torch
        >>> from decodekit import GumbelSamplingLogitsProcessor
        >>> sampler = GumbelSamplingLogitsProcessor([7, 8], prompt_length=1)
        >>> scores = torch.tensor([[0.0, float("-inf")], [float("-inf"), 0.0]])
        >>> sampler(torch.zeros(2, 1, dtype=torch.long), scores).argmax(dim=-1).tolist()
        [0, 1]
    """

    supports_continuous_batching = False

    def __init__(self, seeds: Sequence[int] | torch.Tensor, *, prompt_length: int) -> None:
        self.seeds = integer_rows("seeds", seeds)
        self.prompt_length = check_int("prompt_length", prompt_length, 0, " (the padded prompt length)")

    def _row_seeds(self, rows: int) -> torch.Tensor:
        count = self.seeds.shape[0]
        if count == rows or rows % count:
            return expand_rows(self.seeds, rows, "seeds")
        replicas = rows // count
        replica = torch.arange(replicas, dtype=torch.int64).repeat(count)
        return self.seeds.repeat_interleave(replicas) + replica * REPLICA_STRIDE

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, vocab = check_scores(scores, "GumbelSamplingLogitsProcessor")
        step = input_ids.shape[1] - self.prompt_length
        noise = gumbel_noise(self._row_seeds(rows), step, vocab, scores.device)
        return (scores.float() + noise).to(scores.dtype)
