"""A repetition penalty that grows in stages with how often a token recurred in a recent window."""

from __future__ import annotations

import itertools
import string
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from transformers import LogitsProcessor

from decodekit._validation import as_integer, as_real, check_int, is_int_at_least
from decodekit.logits_processors._counting import occurrence_counts
from decodekit.logits_processors._rows import check_scores, expand_rows, integer_rows

StageTable = Mapping[int, float]
NO_STAGE = torch.iinfo(torch.int32).max  # pads the threshold rows of shorter per-row tables


def parse_stages(text: str) -> dict[int, float]:
    """Parse ``"1:1.2,3:1.5,6:2.0"`` into ``{1: 1.2, 3: 1.5, 6: 2.0}`` (validated like the processor).

    Example:
        >>> parse_stages("1:1.2, 3:1.5")
        {1: 1.2, 3: 1.5}
    """
    table: dict[int, float] = {}
    for item in text.split(","):
        count, separator, penalty = item.partition(":")
        try:
            if not separator:
                raise ValueError
            key = int(count)
            if key in table:
                raise ValueError(f"stages lists the count {key} twice")
            table[key] = float(penalty)
        except ValueError as error:
            detail = str(error) if "twice" in str(error) else f"bad item {item.strip()!r}"
            raise ValueError(f"stages must look like '1:1.2,3:1.5,6:2.0' (count:penalty, ...): {detail}") from None
    check_stage_table(table)
    return table


def check_stage_table(table: Any, name: str = "stages") -> list[tuple[int, float]]:
    """Validate one stage table and return its (count, penalty) pairs in order."""
    if not isinstance(table, Mapping) or not table:
        raise ValueError(f"{name} must be a non-empty mapping from a count (>= 1) to a penalty (> 0); got {table!r}")
    pairs = list(table.items())
    for count, penalty in pairs:
        if not is_int_at_least(count, 1):
            raise ValueError(f"{name}: every count must be an integer >= 1; got {count!r}")
        number = as_real(penalty)
        if number is None or not 0 < number < float("inf"):
            raise ValueError(f"{name}: every penalty must be a finite number > 0; got {penalty!r} for count {count}")
    counts = [count for count, _ in pairs]
    if any(later <= earlier for earlier, later in itertools.pairwise(counts)):
        raise ValueError(f"{name}: counts must be strictly increasing; got {counts}")
    penalties = [penalty for _, penalty in pairs]
    if any(later < earlier for earlier, later in itertools.pairwise(penalties)):
        raise ValueError(f"{name}: penalties must not decrease as the count grows; got {penalties}")
    return [(as_integer(count), as_real(penalty)) for count, penalty in pairs]


def punctuation_token_ids(tokenizer: Any) -> list[int]:
    """Ids of the tokens that decode to punctuation and whitespace only, to exempt from a penalty.

    Example (with a tokenizer from ``load_model``)::

        ids = punctuation_token_ids(tokenizer)
        processor = StagedRepetitionPenaltyLogitsProcessor({2: 1.3}, exempt_token_ids=ids)
    """
    allowed = set(string.punctuation + string.whitespace)
    ids = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if text and set(text) <= allowed:
            ids.append(token_id)
    return ids


class StagedRepetitionPenaltyLogitsProcessor(LogitsProcessor):
    r"""A CTRL-style repetition penalty whose strength depends on how often the token recurred.

    For each token, count its occurrences among the last ``window`` tokens (the whole sequence
    when ``window`` is None); the stage table maps the count to a penalty, applied as in
    transformers' ``RepetitionPenaltyLogitsProcessor``: a positive score is divided by it, a
    negative one multiplied. ``{1: 1.2, 3: 1.5, 6: 2.0}`` penalizes a token seen once or twice by
    1.2, three to five times by 1.5, six or more by 2.0. ``exempt_token_ids`` never count; with
    ``count_prompt=False`` neither do the first ``prompt_length`` positions (the prompt, left
    padding included).

    Padding is not content: a row's left padding never counts, so a prompt gets the same penalty
    alone or in a padded batch, as with transformers' ``repetition_penalty`` (which skips each
    row's padding). Give ``padding_lengths`` (each row's left padding, from the attention mask),
    or ``pad_token_id``: each row's leading run of that id is then its padding, and later
    occurrences (a chat turn separator that is also the pad token) still count.

    With one stage ``{1: p}`` and no window it equals transformers' ``repetition_penalty=p``: bit
    for bit on CPU. On CUDA transformers' division by a Python float runs as a multiplication by
    ``1 / p``, which differs from a true division in the last bit for about 6% of penalized entries
    (measured on an H100); this processor divides.

    Under beam search generate hands processors log-probabilities (all <= 0): every penalized
    score is then multiplied by its penalty, which lowers the token's log-probability by the
    factor; the hypothesis scores accumulate these penalized values.

    Args:
        stages: a mapping {count: penalty} with increasing counts (>= 1) and non-decreasing
            penalties (> 0), a string such as ``"1:1.2,3:1.5"``, or a sequence of mappings, one per
            batch row (or per request, when generate expands requests into beams).
        window: how many of the most recent tokens are counted; >= 1, or None for all.
        count_prompt: whether prompt tokens count (default True, like transformers' penalty).
        exempt_token_ids: token ids never counted nor penalized (special tokens, punctuation:
            see ``punctuation_token_ids``).
        pad_token_id: the pad token id; each row's leading run of it is left padding, never counted.
        padding_lengths: each row's left padding (one int per row, or per request), e.g.
            ``(attention_mask == 0).sum(dim=1)``; takes precedence over ``pad_token_id``.
        prompt_length: the length of the (padded) prompt; needed when ``count_prompt=False``.

    Example:
        >>> import torch
        >>> from decodekit import StagedRepetitionPenaltyLogitsProcessor
        >>> processor = StagedRepetitionPenaltyLogitsProcessor({1: 2.0, 3: 4.0})
        >>> input_ids = torch.tensor([[0, 1, 1, 1]])
        >>> processor(input_ids, torch.tensor([[8.0, 8.0, 8.0]])).tolist()
        [[4.0, 2.0, 8.0]]
    """

    supports_continuous_batching = False

    def __init__(
        self,
        stages: StageTable | str | Sequence[StageTable],
        window: int | None = None,
        count_prompt: bool = True,
        exempt_token_ids: Iterable[int] = (),
        pad_token_id: int | None = None,
        prompt_length: int | None = None,
        padding_lengths: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        tables = self._tables(stages)
        if window is not None:
            check_int("window", window, 1, " or None (the whole sequence)")
        if not isinstance(count_prompt, bool):
            raise TypeError(f"count_prompt must be True or False; got {count_prompt!r}")
        if prompt_length is not None:
            check_int("prompt_length", prompt_length, 0)
        if not count_prompt and prompt_length is None:
            raise ValueError("count_prompt=False needs prompt_length: the length of the padded prompt input_ids")
        self.window = window
        self.count_prompt = count_prompt
        self.prompt_length = prompt_length or 0
        self.uncounted_ids = torch.tensor(
            sorted(set(_token_ids("exempt_token_ids", exempt_token_ids))), dtype=torch.long
        )
        if pad_token_id is not None and not is_int_at_least(pad_token_id, 0):
            raise ValueError(f"pad_token_id must be a token id (an integer >= 0) or None; got {pad_token_id!r}")
        self.pad_token_id = pad_token_id
        self.padding_lengths = None
        if padding_lengths is not None:
            self.padding_lengths = integer_rows("padding_lengths", padding_lengths, minimum=0)
        width = max(len(table) for table in tables)
        self.thresholds = torch.full((len(tables), width), NO_STAGE, dtype=torch.int32)
        self.factors = torch.ones((len(tables), width + 1), dtype=torch.float64)
        for row, table in enumerate(tables):
            for column, (count, penalty) in enumerate(table):
                self.thresholds[row, column] = count
                self.factors[row, column + 1 :] = penalty
        self._cache: dict[tuple[int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def _tables(stages: Any) -> list[list[tuple[int, float]]]:
        if isinstance(stages, str):
            stages = parse_stages(stages)
        if isinstance(stages, Mapping):
            return [check_stage_table(stages)]
        if isinstance(stages, Sequence) and stages:
            return [check_stage_table(table, f"stages[{row}]") for row, table in enumerate(stages)]
        raise ValueError(f"stages must be a mapping {{count: penalty}}, a string or a list of mappings; got {stages!r}")

    def _row_tables(self, rows: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (rows, device, dtype)
        if key not in self._cache:
            thresholds = expand_rows(self.thresholds, rows, "stages").to(device).contiguous()
            factors = expand_rows(self.factors, rows, "stages").to(device=device, dtype=dtype)
            self._cache[key] = (thresholds, factors)
        return self._cache[key]

    def _padding(self, input_ids: torch.LongTensor) -> torch.Tensor | None:
        """Each row's left padding, ``[rows]`` on the ids' device, or None when unknown."""
        if self.padding_lengths is not None:
            self.padding_lengths = self.padding_lengths.to(input_ids.device)
            return expand_rows(self.padding_lengths, input_ids.shape[0], "padding_lengths")
        if self.pad_token_id is None:
            return None
        # The first position that is not the pad id (argmax returns the first maximum).
        return (input_ids != self.pad_token_id).to(torch.int8).argmax(dim=1)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows, vocab = check_scores(scores, "StagedRepetitionPenaltyLogitsProcessor")
        start = 0 if self.window is None else max(input_ids.shape[1] - self.window, 0)
        ids = input_ids[:, start:]
        counted = torch.ones_like(ids, dtype=torch.bool)
        if self.uncounted_ids.numel():
            self.uncounted_ids = self.uncounted_ids.to(ids.device)
            counted &= ~torch.isin(ids, self.uncounted_ids)
        if not self.count_prompt and self.prompt_length > start:
            counted[:, : self.prompt_length - start] = False
        padding = self._padding(input_ids)
        if padding is not None:
            column = torch.arange(start, input_ids.shape[1], device=ids.device)
            counted &= column >= padding[:, None]
        ids, occurrences = occurrence_counts(ids, vocab, counted)
        # Penalize in float32 at least, as transformers does when it divides half-precision scores.
        compute_dtype = torch.promote_types(scores.dtype, torch.float32)
        thresholds, factors = self._row_tables(rows, scores.device, compute_dtype)
        stage = torch.searchsorted(thresholds, occurrences, right=True)
        factor = factors.gather(1, stage)
        selected = scores.gather(1, ids).to(compute_dtype)
        penalized = torch.where(selected < 0, selected * factor, selected / factor)
        return scores.scatter(1, ids, penalized.to(scores.dtype))


def _token_ids(name: str, values: int | Iterable[int] | None) -> list[int]:
    if values is None:
        return []
    items = [values] if isinstance(values, int) and not isinstance(values, bool) else list(values)
    for value in items:
        if not is_int_at_least(value, 0):
            raise ValueError(f"{name} must hold token ids (integers >= 0); got {value!r}")
    return items


def from_strategy(values: Mapping[str, Any], context: Any) -> StagedRepetitionPenaltyLogitsProcessor:
    """The processor for a Strategy's ``staged_penalty`` and ``penalty_window`` (see ``decodekit.fields``)."""
    return StagedRepetitionPenaltyLogitsProcessor(
        values["staged_penalty"], window=values.get("penalty_window"), pad_token_id=context.pad_token_id,
        padding_lengths=context.padding_lengths,
    )  # fmt: skip
