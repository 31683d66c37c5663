"""n-gram entropy as a local evaluate module: ``evaluate.load(decodekit.eval.metric_path("ngram_entropy"))``."""

from decodekit.eval import diversity
from decodekit.eval.metrics import _module


class NgramEntropy(_module.FunctionMetric):
    function = staticmethod(diversity.ngram_entropy)
    description = "Entropy in bits of the corpus's n-gram distribution."
    result_name = "ngram_entropy"
