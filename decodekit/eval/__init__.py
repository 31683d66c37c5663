"""Evaluation of decoding strategies: diversity and repetition metrics of generated texts."""

from decodekit.eval.diversity import (
    compression_ratio,
    distinct_n,
    ngram_entropy,
    rep_window,
    self_bleu,
    seq_rep_n,
    words,
)

__all__ = ["compression_ratio", "distinct_n", "ngram_entropy", "rep_window", "self_bleu", "seq_rep_n", "words"]
