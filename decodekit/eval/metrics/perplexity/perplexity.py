"""Perplexity as a local evaluate module (load it with decodekit.eval.metric_path("perplexity")).

``compute(predictions=texts, model=<model object or path; None for the default>, tokenizer=...,
max_length=..., stride=..., add_bos=True)`` returns per-text perplexities, their mean, and the
corpus perplexity exp(total NLL / total tokens).
"""

from typing import Any

import datasets
import evaluate

from decodekit.eval.perplexity import perplexity


class Perplexity(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Sliding-window perplexity of texts under a causal language model.",
            citation="",
            inputs_description="predictions: list of texts; model, tokenizer, max_length, stride, add_bos",
            features=datasets.Features({"predictions": datasets.Value("string")}),
        )

    def _compute(self, predictions: list[str], model: Any = None, **settings: Any) -> dict[str, Any]:
        if model is None or isinstance(model, str):  # a name or path: load it (None is the default model)
            from decodekit.models import load_model

            model, settings["tokenizer"] = load_model(model)
        result = perplexity(predictions, model, **settings)
        return {
            "perplexities": result.perplexities,
            "mean_perplexity": result.mean_perplexity,
            "corpus_perplexity": result.corpus_perplexity,
        }
