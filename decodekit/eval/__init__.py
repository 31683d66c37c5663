"""Evaluation of decoding strategies: diversity, repetition and perplexity of generated texts.

Each metric is a plain function here and a local ``evaluate`` module that loads offline:

    >>> import evaluate
    >>> distinct = evaluate.load(metric_path("distinct_n"))
    >>> distinct.compute(predictions=["a b a b"], n=2)
    {'distinct_n': 0.6666666666666666}
"""

from pathlib import Path

from decodekit.eval.diversity import (
    compression_ratio,
    distinct_n,
    ngram_entropy,
    rep_window,
    self_bleu,
    seq_rep_n,
    words,
)
from decodekit.eval.mauve import mauve
from decodekit.eval.perplexity import PerplexityResult, perplexity

METRICS = (
    "distinct_n",
    "self_bleu",
    "seq_rep_n",
    "rep_window",
    "ngram_entropy",
    "compression_ratio",
    "perplexity",
    "mauve",
)


def metric_path(name: str) -> str:
    """The folder of decodekit's local evaluate module ``name``, for ``evaluate.load``."""
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; decodekit has {', '.join(METRICS)}")
    return str(Path(__file__).parent / "metrics" / name)


def __getattr__(name: str):
    """``evaluate_strategies`` (the runner) loads on first use: the metrics alone import no model code."""
    if name == "evaluate_strategies":
        from decodekit.eval.runner import evaluate_strategies

        return evaluate_strategies
    raise AttributeError(f"module 'decodekit.eval' has no attribute {name!r}")


__all__ = [
    "METRICS",
    "PerplexityResult",
    "compression_ratio",
    "distinct_n",
    "evaluate_strategies",
    "mauve",
    "metric_path",
    "ngram_entropy",
    "perplexity",
    "rep_window",
    "self_bleu",
    "seq_rep_n",
    "words",
]
