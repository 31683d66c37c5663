"""DRY ("don't repeat yourself"): penalize the token that would extend a sequence already seen."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from transformers import LogitsProcessor

from decodekit._validation import check_int, check_real
from decodekit.logits_processors._rows import check_scores
from decodekit.settings import DRY_BASE_RANGE, DRY_MAX_MATCH, DRY_MULTIPLIER_RANGE, DRY_SEQUENCE_BREAKERS

MAX_MATCH = DRY_MAX_MATCH  # a longer match scores as this long: its penalty already exceeds any logit gap


def breaker_token_ids(tokenizer: Any, breakers: Iterable[str]) -> list[int]:
    """The token ids of the sequence breakers: every token each breaker string encodes into.

    Example (with a tokenizer from ``load_model``)::

        breaker_token_ids(tokenizer, ["\\n", ":"])
    """
    ids: set[int] = set()
    for index, text in enumerate(breakers):
        if not isinstance(text, str) or not text:
            raise ValueError(f"dry_sequence_breakers[{index}] must be a non-empty string; got {text!r}")
        ids.update(tokenizer.encode(text, add_special_tokens=False))
    return sorted(ids)


class DRYLogitsProcessor(LogitsProcessor):
    r"""DRY repetition penalty (from text-generation-webui, also in llama.cpp and koboldcpp).

    For each candidate token t, look for earlier places in the last ``penalty_last_n`` tokens where
    t followed the same tokens that end the text now. The longest such match, of length L (the
    number of tokens before t that agree with the end of the text), sets the penalty: if L >=
    ``allowed_length``, t's logit drops by ``multiplier * base ** (L - allowed_length)``. A
    sequence breaker (a newline, a colon...) ends every match: a match never runs through one,
    and a breaker is never penalized. Matches longer than 50 tokens count as 50, as in
    text-generation-webui (their penalty is already overwhelming).

    Computed in one pass over ``[rows, penalty_last_n, 50]`` comparisons per step, with no loop
    over rows or tokens and no host sync; the penalty is subtracted from the scores' own dtype.

    Args:
        multiplier: the penalty's scale; > 0 (0 would disable DRY: leave it out instead).
        base: the growth per extra matched token; >= 1 (default 1.75).
        allowed_length: the longest repetition left unpenalized; >= 1 (default 2).
        sequence_breaker_ids: token ids that end a match (see ``breaker_token_ids``).
        penalty_last_n: how many recent tokens are searched; >= 1 (default 1024).

    Example:
        >>> import torch
        >>> dry = DRYLogitsProcessor(multiplier=1.0, base=2.0, allowed_length=2)
        >>> ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])  # "5 6 7" was followed by 8 before
        >>> dry(ids, torch.zeros(1, 10))[0, 8].item()  # L = 3: 1.0 * 2 ** (3 - 2)
        -2.0
    """

    supports_continuous_batching = False

    def __init__(
        self,
        multiplier: float,
        base: float = 1.75,
        allowed_length: int = 2,
        sequence_breaker_ids: Sequence[int] | torch.Tensor = (),
        penalty_last_n: int = 1024,
    ) -> None:
        self.multiplier = check_real("dry_multiplier", multiplier, *DRY_MULTIPLIER_RANGE, low_open=True)
        self.base = check_real("dry_base", base, *DRY_BASE_RANGE)
        self.allowed_length = check_int("dry_allowed_length", allowed_length, 1, maximum=MAX_MATCH)
        self.penalty_last_n = check_int("dry_penalty_last_n", penalty_last_n, 1)
        breakers = torch.as_tensor(list(sequence_breaker_ids) if not isinstance(sequence_breaker_ids, torch.Tensor)
                                   else sequence_breaker_ids, dtype=torch.long).flatten()  # fmt: skip
        if breakers.numel() and bool((breakers < 0).any()):
            raise ValueError("sequence_breaker_ids must be token ids (integers >= 0)")
        self.breakers = breakers
        # Penalty per match length 0..MAX_MATCH (0 below allowed_length).
        lengths = torch.arange(MAX_MATCH + 1, dtype=torch.float64)
        self._penalties = torch.where(
            lengths >= self.allowed_length, self.multiplier * self.base ** (lengths - self.allowed_length), 0.0
        ).to(torch.float32)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        _, vocab = check_scores(scores, "DRYLogitsProcessor")
        window = min(input_ids.shape[1], self.penalty_last_n)
        if window < 2:
            return scores
        device = scores.device
        ids = input_ids[:, -window:].to(device)
        if self.breakers.numel():
            self.breakers = self.breakers.to(device)
            broken = torch.isin(ids, self.breakers)
        else:
            broken = torch.zeros_like(ids, dtype=torch.bool)
        # For a candidate at position i (it followed ids[:i]), agree[r, i, j]: the j-th token before
        # it equals the j-th token before the end, and neither is a breaker.
        depth = min(MAX_MATCH, window - 1)
        candidates = torch.arange(1, window, device=device)  # a candidate follows an earlier token
        back = torch.arange(depth, device=device)
        before = candidates[:, None] - 1 - back[None, :]  # [window-1, depth]
        valid = before >= 0
        before = before.clamp(min=0)
        end = (window - 1 - back).clamp(min=0)  # the j-th token before the end
        past = ids[:, before]  # [rows, window-1, depth]
        recent = ids[:, end][:, None, :]  # [rows, 1, depth]
        agree = (past == recent) & valid & ~broken[:, before] & ~broken[:, end][:, None, :]
        lengths = agree.to(torch.int32).cumprod(dim=-1).sum(dim=-1)  # [rows, window-1]: leading agreements
        tokens = ids[:, 1:]
        counted = (tokens < vocab) & ~broken[:, 1:]  # a breaker is never penalized
        self._penalties = self._penalties.to(device)  # moved once; a no-op afterwards
        penalty = self._penalties[lengths.long()] * counted
        tokens = tokens.clamp(max=vocab - 1)
        # A token's score drops by its largest penalty: the smallest of (score - penalty) over its
        # occurrences, written in one scatter (a penalty of 0 leaves the score as it is).
        lowered = (scores.gather(1, tokens).float() - penalty).to(scores.dtype)
        return scores.scatter_reduce(1, tokens, lowered, reduce="amin", include_self=True)


def from_strategy(values: Mapping[str, Any], context: Any) -> DRYLogitsProcessor:
    """The processor for a Strategy's ``dry_*`` fields; the breakers are tokenized with the context's tokenizer."""
    breakers = values.get("dry_sequence_breakers", DRY_SEQUENCE_BREAKERS)
    tokenizer = context.require_tokenizer("dry_sequence_breakers (DRY)")
    return DRYLogitsProcessor(
        values["dry_multiplier"], values.get("dry_base", 1.75), values.get("dry_allowed_length", 2),
        sequence_breaker_ids=breaker_token_ids(tokenizer, breakers),
        penalty_last_n=values.get("dry_penalty_last_n", 1024),
    )  # fmt: skip
