"""seq-rep-n as a local evaluate module: ``evaluate.load(decodekit.eval.metric_path("seq_rep_n"))``."""

from decodekit.eval import diversity
from decodekit.eval.metrics import _module


class SeqRepN(_module.FunctionMetric):
    function = staticmethod(diversity.seq_rep_n)
    description = "Welleck et al. (2019) seq-rep-n: 1 - unique n-grams / n-grams per text, averaged."
    result_name = "seq_rep_n"
