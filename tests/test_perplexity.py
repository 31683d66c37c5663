"""Perplexity against a plain reference loop of the sliding-window method, and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit.eval.perplexity import perplexity

TEXTS = [
    "The class statement creates a new class object and binds it to a name in the local namespace. " * 3,
    "def foo(bar): return bar",
    "x = 1",
]


def _reference(model, tokenizer, text, max_length, stride, add_bos):
    """One window at a time: score each token once, with the tokens before it in its window as context."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if add_bos:
        ids = [tokenizer.bos_token_id, *ids]
    nll, count, scored_until = 0.0, 0, 1
    for begin in range(0, len(ids), stride):
        end = min(begin + max_length, len(ids))
        with torch.no_grad():
            log_probs = torch.log_softmax(model(torch.tensor([ids[begin:end]])).logits[0].float(), dim=-1)
        for position in range(max(scored_until, begin + 1), end):
            nll -= float(log_probs[position - begin - 1, ids[position]])
            count += 1
        scored_until = max(scored_until, end)
        if end == len(ids):
            break
    return nll, count


@pytest.mark.parametrize(("max_length", "stride", "add_bos"), [(32, 16, True), (32, 32, True), (24, 7, False)])
def test_equals_the_reference_loop_per_text_and_for_the_corpus(tiny, max_length, stride, add_bos):
    model, tokenizer = tiny
    result = perplexity(TEXTS, model, tokenizer, max_length=max_length, stride=stride, add_bos=add_bos, batch_size=3)
    references = [_reference(model, tokenizer, text, max_length, stride, add_bos) for text in TEXTS]
    for value, (nll, count) in zip(result.perplexities, references, strict=True):
        assert value == pytest.approx(math.exp(nll / count), rel=1e-4)
    total_nll = sum(nll for nll, _ in references)
    total_count = sum(count for _, count in references)
    assert result.scored_tokens == total_count
    assert result.corpus_perplexity == pytest.approx(math.exp(total_nll / total_count), rel=1e-4)
    assert result.corpus_perplexity != pytest.approx(result.mean_perplexity, rel=1e-3)


def test_a_text_longer_than_the_window_is_scored_in_several_windows(tiny):
    model, tokenizer = tiny
    long_text = TEXTS[0]
    assert len(tokenizer(long_text)["input_ids"]) > 64
    whole = perplexity([long_text], model, tokenizer, max_length=512).perplexities[0]
    windowed = perplexity([long_text], model, tokenizer, max_length=16, stride=8).perplexities[0]
    assert whole != pytest.approx(windowed, rel=1e-3)  # less context, a different value


@pytest.mark.parametrize(
    ("texts", "kwargs", "message"),
    [
        ([], {}, "non-empty list"),
        ([""], {"add_bos": False}, r"texts\[0\] has no token to score"),
        (["hello there"], {"max_length": 8, "stride": 9}, r"stride must be <= max_length \(8\)"),
        (["hello there"], {"max_length": 1}, "max_length must be an integer >= 2"),
        (["hello there"], {"stride": 0}, "stride must be an integer >= 1"),
    ],
)
def test_bad_input_is_named(tiny, texts, kwargs, message):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match=message):
        perplexity(texts, model, tokenizer, **kwargs)


def test_the_evaluate_module_gives_the_same_values(tiny):
    import evaluate

    from decodekit.eval import metric_path

    model, tokenizer = tiny
    module = evaluate.load(metric_path("perplexity"))
    result = module.compute(predictions=TEXTS, model=model, tokenizer=tokenizer, max_length=32, stride=16)
    direct = perplexity(TEXTS, model, tokenizer, max_length=32, stride=16)
    assert result["perplexities"] == direct.perplexities
    assert result["corpus_perplexity"] == direct.corpus_perplexity


def test_the_evaluate_module_loads_a_model_path_with_its_tokenizer(tiny, tiny_model_dir):
    import evaluate

    from decodekit.eval import metric_path

    model, tokenizer = tiny
    module = evaluate.load(metric_path("perplexity"))
    by_path = module.compute(predictions=TEXTS, model=str(tiny_model_dir), max_length=32, stride=16)
    assert by_path["perplexities"] == pytest.approx(
        perplexity(TEXTS, model, tokenizer, max_length=32, stride=16).perplexities
    )
    with pytest.raises(TypeError, match="model must be a loaded causal LM"):
        perplexity(TEXTS, str(tiny_model_dir))
