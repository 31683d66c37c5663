"""MAUVE as a local evaluate module (load it with decodekit.eval.metric_path("mauve")).

``compute(predictions=generated, references=human, model=..., tokenizer=...)`` returns
``{"mauve": area under the divergence curve}``, on features of the given (local) model.
"""

from typing import Any

import datasets
import evaluate

from decodekit.eval.mauve import mauve


class Mauve(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="MAUVE between generated and reference texts, on a local model's features.",
            citation="Pillutla et al., MAUVE, NeurIPS 2021",
            inputs_description="predictions, references: lists of texts; model, tokenizer, clusters, seed",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions: list[str], references: list[str], **settings: Any) -> dict[str, float]:
        return {"mauve": mauve(predictions, references, **settings)}
