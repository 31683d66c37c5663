"""distinct-n as a local evaluate module: ``evaluate.load(decodekit.eval.metric_path("distinct_n"))``."""

from decodekit.eval import diversity
from decodekit.eval.metrics import _module


class DistinctN(_module.FunctionMetric):
    function = staticmethod(diversity.distinct_n)
    description = "Unique n-grams over all n-grams (per='ngrams') or over all tokens (per='tokens')."
    result_name = "distinct_n"
