"""The processors never read tensor values on the host and do the same work whatever the batch size.

Meta tensors carry shapes but no data: ``.item()``, ``.tolist()``, ``.cpu()``, ``bool(tensor)``
and data-dependent shapes all raise on them, so a processor that runs on meta tensors cannot
synchronize with its device. Counting the operators dispatched for a batch of 2 and of 64 shows
that no Python loop runs over the rows.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LogitsProcessor

from decodekit import (
    DRYLogitsProcessor,
    FrequencyPresencePenaltyLogitsProcessor,
    MinKLogitsProcessor,
    MinPLogitsProcessor,
    MirostatLogitsProcessor,
    StagedRepetitionPenaltyLogitsProcessor,
    TopNSigmaLogitsProcessor,
    XTCLogitsProcessor,
)

VOCAB, LENGTH, PROMPT = 300, 40, 10


def _row_values(rows: int, low: float, high: float) -> torch.Tensor:
    return torch.linspace(low, high, rows)


PROCESSORS: dict[str, Callable[[int], LogitsProcessor]] = {
    "min-p": lambda rows: MinPLogitsProcessor(0.1, temperature=0.7),
    "min-p per row, keep 3, finite filter": lambda rows: MinPLogitsProcessor(
        _row_values(rows, 0.0, 0.5), min_tokens_to_keep=3, filter_value=-50.0, temperature=_row_values(rows, 0.5, 2)
    ),
    "staged penalty, window": lambda rows: StagedRepetitionPenaltyLogitsProcessor(
        {1: 1.2, 3: 1.5, 6: 2.0}, window=16, exempt_token_ids=[1, 2], pad_token_id=0
    ),
    "staged penalty per row, generated only": lambda rows: StagedRepetitionPenaltyLogitsProcessor(
        [{1: 1.1 + row / rows, 4: 3.0} for row in range(rows)], count_prompt=False, prompt_length=PROMPT
    ),
    "frequency/presence": lambda rows: FrequencyPresencePenaltyLogitsProcessor(
        0.3, _row_values(rows, 0.0, 1.0), prompt_length=PROMPT
    ),
    "DRY with breakers": lambda rows: DRYLogitsProcessor(0.8, sequence_breaker_ids=[3, 4], penalty_last_n=32),
    "XTC per row, seeded": lambda rows: XTCLogitsProcessor(
        _row_values(rows, 0.05, 0.2), 0.7, temperature=0.8, seeds=list(range(rows)), prompt_length=PROMPT
    ),
    "top-n-sigma per row": lambda rows: TopNSigmaLogitsProcessor(_row_values(rows, 0.5, 2.0)),
    "min-k per row": lambda rows: MinKLogitsProcessor(_row_values(rows, 0.5, 2.0)),
    "mirostat": lambda rows: MirostatLogitsProcessor(5.0, 0.1, temperature=0.9),
}


class _OperatorCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _inputs(rows: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    input_ids = torch.randint(0, VOCAB, (rows, LENGTH), generator=generator)
    scores = torch.randn(rows, VOCAB, generator=generator)
    return input_ids.to(device), scores.to(device)


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_runs_on_meta_tensors_so_never_reads_values_on_the_host(name):
    processor = PROCESSORS[name](4)
    input_ids, scores = _inputs(4, "meta")
    for _ in range(2):  # the first call may build per-shape constants; both must stay on the device
        out = processor(input_ids, scores)
        assert out.device.type == "meta" and out.shape == scores.shape and out.dtype == scores.dtype


def test_a_host_read_would_be_caught():
    class Syncing(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores - scores.max().item()

    with pytest.raises(RuntimeError, match="meta"):
        Syncing()(*_inputs(4, "meta"))


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_dispatches_as_many_operators_for_64_rows_as_for_2(name):
    counts = {}
    for rows in (2, 64):
        processor = PROCESSORS[name](rows)
        input_ids, scores = _inputs(rows, "cpu")
        processor(input_ids, scores)  # per-shape constants are built on the first call
        with _OperatorCounter() as counter:
            processor(input_ids, scores)
        counts[rows] = counter.calls
    assert counts[2] == counts[64] > 0
