"""Sampling with one seed per row, so that a prompt draws the same tokens alone or in any batch."""

from __future__ import annotations

import functools
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
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 tensors holding values below 2**32.
    ``values`` itself is left as it was; the rounds work in place on one new tensor."""
    values = values ^ (values >> 16)
    for index, multiplier in enumerate(MULTIPLIERS):
        if index:
            values ^= values >> 16
        values.mul_(multiplier).bitwise_and_(MASK32)
    values ^= values >> 16
    return values


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """32-bit centred uniforms ``(bits + 0.5) / 2**32`` in float64 (exact): strictly inside (0, 1) for every
    value of ``bits`` (int64 tensors holding values below 2**32).

    Example:
        >>> uniform_from_bits(torch.tensor([0, 2**32 - 1])).tolist() == [0.5 / 2**32, 1 - 0.5 / 2**32]
        True
    """
    return bits.to(torch.float64).add_(0.5).mul_(2.0**-32)


def gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 Gumbel(0, 1) noise ``-log(-log(u))`` of the 32-bit centred uniforms ``u`` of ``bits``
    (int64 tensors holding values below 2**32): finite for every bit pattern, non-decreasing in ``bits``.

    ``u`` is formed in float64, where it is exact, and so is ``-log(u)`` to float32's precision even for
    ``u`` within 2**-33 of 1 (in float32 such a ``u`` rounds to 1.0: infinite noise). The noise then spans
    about -3.13 to 22.9, and its tails follow the Gumbel law down to the resolution of 32 bits.

    Example:
        >>> noise = gumbel_from_bits(torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]))
        >>> bool(noise.isfinite().all()), bool((noise.diff() >= 0).all()), round(float(noise[-1]), 2)
        (True, True, 22.87)
    """
    exponential = uniform_from_bits(bits).log_().neg_().to(torch.float32)  # -log(u) > 0, never 0
    return exponential.log_().neg_()


def uniform_draws(seeds: torch.Tensor, step: int, device: torch.device, stream: int = 1) -> torch.Tensor:
    """``[rows]`` float64 uniform draws in (0, 1) with 32 bits each, a pure function of (seed, step, stream).

    ``stream`` separates independent uses of one seed (XTC's coin flips from sampling's noise).

    Example:
        >>> cpu = torch.device("cpu")
        >>> a = uniform_draws(torch.tensor([1, 2]), 3, cpu)
        >>> bool(((a > 0) & (a < 1)).all()), torch.equal(a[1:], uniform_draws(torch.tensor([2]), 3, cpu))
        (True, True)
    """
    key = _mix((seeds.to(device=device, dtype=torch.int64) & MASK32) ^ _mix(torch.tensor(step, device=device)))
    bits = _mix(key ^ _mix(torch.tensor(stream + MULTIPLIERS[1], device=device)))
    return uniform_from_bits(bits)


def gumbel_noise(seeds: torch.Tensor, step: int, vocab: int, device: torch.device) -> torch.Tensor:
    """``[rows, vocab]`` float32 Gumbel(0, 1) noise from 32-bit uniforms, a pure function of (seed, step, token).

    Example:
        >>> a = gumbel_noise(torch.tensor([1, 2]), 0, 5, torch.device("cpu"))
        >>> b = gumbel_noise(torch.tensor([2]), 0, 5, torch.device("cpu"))
        >>> torch.equal(a[1], b[0])
        True
    """
    key = _mix((seeds.to(device=device, dtype=torch.int64) & MASK32) ^ _mix(torch.tensor(step, device=device)))
    return gumbel_from_bits(_mix(key[:, None] ^ _token_hashes(vocab, device)))


@functools.lru_cache(maxsize=8)
def _token_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """Each token id's hash, the same at every step (computed once per vocabulary size and device)."""
    return _mix(torch.arange(vocab, device=device, dtype=torch.int64) + MULTIPLIERS[0])


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
