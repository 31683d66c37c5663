"""rep/l as a local evaluate module: ``evaluate.load(decodekit.eval.metric_path("rep_window"))``."""

from decodekit.eval import diversity
from decodekit.eval.metrics import _module


class RepWindow(_module.FunctionMetric):
    function = staticmethod(diversity.rep_window)
    description = "Welleck et al. (2019) rep/l: share of tokens already seen among the window tokens before them."
    result_name = "rep_window"
