"""self-BLEU as a local evaluate module: ``evaluate.load(decodekit.eval.metric_path("self_bleu"))``."""

from decodekit.eval import diversity
from decodekit.eval.metrics import _module


class SelfBleu(_module.FunctionMetric):
    function = staticmethod(diversity.self_bleu)
    description = (
        "Mean BLEU of each text against the others (nltk sentence_bleu, smoothing method 2); lower is more diverse."
    )
    result_name = "self_bleu"
