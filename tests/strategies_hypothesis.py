"""Hypothesis strategies shared by the processor tests: random scores with some -inf entries."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def score_batches(draw, max_rows: int = 5, max_vocab: int = 64, dtypes=None, allow_neg_inf: bool = True):
    """``scores`` of shape [rows, vocab] in a drawn dtype; some entries -inf, never a whole row."""
    rows = draw(st.integers(1, max_rows))
    vocab = draw(st.integers(2, max_vocab))
    dtype = draw(st.sampled_from(dtypes or DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.1, 1.0, 5.0, 30.0]))
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * scale
    if allow_neg_inf and draw(st.booleans()):
        banned = torch.rand(rows, vocab, generator=generator) < 0.3
        banned[:, 0] = False
        scores = scores.masked_fill(banned, float("-inf"))
    return scores.to(dtype)


@st.composite
def token_histories(draw, rows: int, vocab: int, max_length: int = 40):
    """``input_ids`` of shape [rows, length] drawn from a small alphabet, so tokens recur."""
    length = draw(st.integers(0, max_length))
    alphabet = draw(st.integers(1, vocab))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, alphabet, (rows, length), generator=generator)
