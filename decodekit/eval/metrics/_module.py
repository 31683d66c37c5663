"""What decodekit's local ``evaluate`` modules share: a Metric whose compute calls a plain function.

Each module in this folder (``metrics/<name>/<name>.py``) defines one subclass; load it offline
with ``evaluate.load(decodekit.eval.metric_path("<name>"))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import datasets
import evaluate


class FunctionMetric(evaluate.Metric):
    """An ``evaluate.Metric`` over a list of predicted texts, computed by ``function``."""

    function: Callable[..., float]
    description: str = ""
    result_name: str = ""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=self.description,
            citation="",
            inputs_description="predictions: list of generated texts; keyword arguments as the function's",
            features=datasets.Features({"predictions": datasets.Value("string")}),
        )

    def _compute(self, predictions: list[str], **settings: Any) -> dict[str, float]:
        return {self.result_name: self.function(predictions, **settings)}
