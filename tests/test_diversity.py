"""Diversity metrics: hand-computed values, nltk's BLEU as the self-BLEU oracle, and bad input."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

from decodekit.eval import compression_ratio, distinct_n, ngram_entropy, rep_window, self_bleu, seq_rep_n, words

CORPUS = ["the cat sat on the mat", "the cat sat", "a dog ran on the grass"]


def test_distinct_n_by_hand():
    # bigrams: (the cat)(cat sat)(sat on)(on the)(the mat) | (the cat)(cat sat)
    #          | (a dog)(dog ran)(ran on)(on the)(the grass): 12 bigrams, 9 unique; 15 tokens, 9 distinct
    assert distinct_n(CORPUS, 2) == pytest.approx(9 / 12)
    assert distinct_n(CORPUS, 2, per="tokens") == pytest.approx(9 / 15)
    assert distinct_n(CORPUS, 1) == pytest.approx(9 / 15)


def test_repetition_metrics_by_hand():
    assert seq_rep_n(["a b a b a b", "x y z"], 2) == pytest.approx(((1 - 2 / 5) + 0) / 2)
    # tokens after the first: b(no) a(yes) b(yes) c(no) with window 2 -> 2 / 4
    assert rep_window(["a b a b c"], 2) == pytest.approx(2 / 4)
    assert rep_window(["a b c a"], 2) == 0.0  # the second "a" is 3 tokens back
    assert ngram_entropy(["a a b b"], 1) == pytest.approx(1.0)
    expected = -(2 / 3 * math.log2(2 / 3) + 1 / 3 * math.log2(1 / 3))  # bigrams (a a)(a b)... -> aa, ab, bb
    assert ngram_entropy(["a a a b"], 2) == pytest.approx(expected)


def test_compression_ratio_grows_with_repetition():
    assert compression_ratio(["la " * 200]) > 10 > compression_ratio(CORPUS) > 0


def _nltk_self_bleu(texts, max_n):
    tokenized = [words(text) for text in texts]
    weights = (1 / max_n,) * max_n
    smoothing = SmoothingFunction().method2
    scores = []
    for index, hypothesis in enumerate(tokenized):
        references = tokenized[:index] + tokenized[index + 1 :]
        scores.append(sentence_bleu(references, hypothesis, weights=weights, smoothing_function=smoothing))
    return sum(scores) / len(scores)


@pytest.mark.parametrize("max_n", [1, 2, 4])
def test_self_bleu_equals_nltk_on_a_fixed_corpus(max_n):
    assert self_bleu(CORPUS, max_n) == pytest.approx(_nltk_self_bleu(CORPUS, max_n))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(["a", "b", "c", "d", "the", "."]), min_size=1, max_size=12).map(" ".join),
        min_size=2,
        max_size=5,
    ),
    st.integers(1, 4),
)
def test_self_bleu_equals_nltk_on_random_corpora(texts, max_n):
    assert self_bleu(texts, max_n) == pytest.approx(_nltk_self_bleu(texts, max_n))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: distinct_n([], 2), ValueError, "predictions is empty"),
        (lambda: distinct_n(["a b"], 0), ValueError, "n must be an integer >= 1"),
        (lambda: seq_rep_n(["a"], -1), ValueError, "n must be an integer >= 1"),
        (lambda: rep_window(["a"], 0), ValueError, "window must be an integer >= 1"),
        (lambda: self_bleu(["only one"]), ValueError, "at least two predictions"),
        (lambda: distinct_n("a b", 1), TypeError, "sequence of strings"),
        (lambda: distinct_n(["a", 3], 1), TypeError, r"predictions\[1\] must be a string"),
        (lambda: distinct_n(["a"], 1, per="words"), ValueError, "per must be"),
    ],
)
def test_bad_input_is_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_empty_strings_give_documented_zeros_not_nan():
    empty = ["", ""]
    values = [
        distinct_n(empty, 2),
        seq_rep_n(empty, 2),
        rep_window(empty, 4),
        ngram_entropy(empty, 2),
        self_bleu(empty),
        compression_ratio(empty),
    ]
    assert all(not math.isnan(value) for value in values)
    assert values[:5] == [0.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("name", "settings"),
    [
        ("distinct_n", {"n": 2}),
        ("self_bleu", {"max_n": 2}),
        ("seq_rep_n", {"n": 2}),
        ("rep_window", {"window": 3}),
        ("ngram_entropy", {"n": 1}),
        ("compression_ratio", {}),
    ],
)
def test_each_metric_loads_offline_as_an_evaluate_module_with_the_same_value(name, settings):
    import evaluate

    from decodekit import eval as decodekit_eval

    module = evaluate.load(decodekit_eval.metric_path(name))
    result = module.compute(predictions=CORPUS, **settings)
    assert result == {name: getattr(decodekit_eval, name)(CORPUS, **settings)}


def test_an_unknown_metric_name_is_refused():
    from decodekit.eval import metric_path

    with pytest.raises(ValueError, match="unknown metric 'bleurt'"):
        metric_path("bleurt")
