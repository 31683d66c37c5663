"""Diversity and repetition metrics of generated texts, as plain functions.

Texts are split into words and punctuation marks by :func:`words` (lower-cased, no download).
Each function raises ValueError for an empty list or an ``n`` below 1 and never returns NaN: a
text too short to hold an n-gram contributes no n-grams, and a corpus with none scores 0.0.
"""

from __future__ import annotations

import gzip
import math
import re
from collections import Counter
from collections.abc import Sequence

_WORD = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    """Lower-cased words and punctuation marks.

    Example:
        >>> words("Hello, World! Hello.")
        ['hello', ',', 'world', '!', 'hello', '.']
    """
    return _WORD.findall(text.lower())


def _check(texts: Sequence[str], n: int, name: str = "n") -> list[list[str]]:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError("predictions must be a sequence of strings")
    if not texts:
        raise ValueError("predictions is empty: give at least one text")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be an integer >= 1; got {n!r}")
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"predictions[{index}] must be a string; got {type(text).__name__}")
    return [words(text) for text in texts]


def ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    """The n-grams of ``tokens`` in order.

    Example:
        >>> ngrams(["a", "b", "c"], 2)
        [('a', 'b'), ('b', 'c')]
    """
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(texts: Sequence[str], n: int = 2, *, per: str = "ngrams") -> float:
    """Distinct-n over the whole corpus: unique n-grams divided by all n-grams (``per="ngrams"``)
    or by all tokens (``per="tokens"``, as Li et al. 2016 report it).

    Example:
        >>> distinct_n(["a b a b"], 2)  # (a b), (b a), (a b): 2 unique of 3
        0.6666666666666666
        >>> distinct_n(["a b a b"], 2, per="tokens")  # 2 unique over 4 tokens
        0.5
    """
    if per not in ("ngrams", "tokens"):
        raise ValueError(f"per must be 'ngrams' or 'tokens'; got {per!r}")
    tokenized = _check(texts, n)
    grams = [gram for tokens in tokenized for gram in ngrams(tokens, n)]
    total = len(grams) if per == "ngrams" else sum(len(tokens) for tokens in tokenized)
    return len(set(grams)) / total if total else 0.0


def seq_rep_n(texts: Sequence[str], n: int = 4) -> float:
    """Welleck et al. (2019) seq-rep-n: per text, 1 - unique n-grams / n-grams; averaged over texts
    that hold at least one n-gram (0.0 when none does).

    Example:
        >>> seq_rep_n(["a b a b"], 2)  # 1 - 2/3
        0.33333333333333337
    """
    values = []
    for tokens in _check(texts, n):
        grams = ngrams(tokens, n)
        if grams:
            values.append(1.0 - len(set(grams)) / len(grams))
    return sum(values) / len(values) if values else 0.0


def rep_window(texts: Sequence[str], window: int = 16) -> float:
    """Welleck et al. (2019) rep/l: the share of tokens that already occurred among the ``window``
    tokens before them, over all tokens after the first of each text.

    Example:
        >>> rep_window(["a b a c"], 2)  # b: no, a: yes (a b), c: no
        0.3333333333333333
    """
    repeated = counted = 0
    for tokens in _check(texts, window, "window"):
        for index in range(1, len(tokens)):
            counted += 1
            repeated += tokens[index] in tokens[max(0, index - window) : index]
    return repeated / counted if counted else 0.0


def ngram_entropy(texts: Sequence[str], n: int = 2) -> float:
    """Shannon entropy, in bits, of the corpus's n-gram frequency distribution.

    Example:
        >>> ngram_entropy(["a b c d"], 1)  # four equally frequent words
        2.0
    """
    counts = Counter(gram for tokens in _check(texts, n) for gram in ngrams(tokens, n))
    total = sum(counts.values())
    return -sum(count / total * math.log2(count / total) for count in counts.values()) if total else 0.0


def compression_ratio(texts: Sequence[str]) -> float:
    """Size of the texts joined by newlines divided by its gzip-compressed size (higher means more
    repetitive; Shaib et al. 2024). gzip runs with a fixed mtime, so the value is reproducible.

    Example:
        >>> compression_ratio(["to be or not to be " * 50]) > compression_ratio(["The quick brown fox."])
        True
    """
    _check(texts, 1)
    raw = "\n".join(texts).encode("utf-8")
    return len(raw) / len(gzip.compress(raw, compresslevel=9, mtime=0))


def self_bleu(texts: Sequence[str], max_n: int = 4) -> float:
    """Self-BLEU (Zhu et al. 2018): the mean BLEU of each text against all the others as references.

    Sentence BLEU here: clipped n-gram precisions for n = 1..max_n with add-one smoothing for
    n > 1 (Lin & Och 2004), an order longer than the text counting as 0 matches of 1, geometric
    mean, times the brevity penalty against the closest reference length: the value nltk's
    ``sentence_bleu`` gives with smoothing method 2. Texts with no words score 0. Needs at least
    two texts.

    Example:
        >>> self_bleu(["the cat sat", "the cat sat"], max_n=2)
        1.0
    """
    tokenized = _check(texts, max_n, "max_n")
    if len(tokenized) < 2:
        raise ValueError("self_bleu needs at least two predictions")
    scores = [
        _sentence_bleu(hypothesis, tokenized[:index] + tokenized[index + 1 :], max_n)
        for index, hypothesis in enumerate(tokenized)
    ]
    return sum(scores) / len(scores)


def _sentence_bleu(hypothesis: list[str], references: list[list[str]], max_n: int) -> float:
    if not hypothesis:
        return 0.0
    log_precision = 0.0
    for n in range(1, max_n + 1):
        counts = Counter(ngrams(hypothesis, n))
        most_in_a_reference: Counter = Counter()
        for reference in references:
            most_in_a_reference |= Counter(ngrams(reference, n))
        clipped = sum(min(count, most_in_a_reference[gram]) for gram, count in counts.items())
        total = max(1, sum(counts.values()))  # an order longer than the text counts as 0 of 1
        smoothing = 1 if n > 1 else 0
        if clipped + smoothing == 0:
            return 0.0
        log_precision += math.log((clipped + smoothing) / (total + smoothing)) / max_n
    lengths = [len(reference) for reference in references]
    closest = min(lengths, key=lambda length: (abs(length - len(hypothesis)), length))
    brevity = 1.0 if len(hypothesis) >= closest else math.exp(1 - closest / len(hypothesis))
    return brevity * math.exp(log_precision)
