"""gzip compression ratio as a local evaluate module (load it with decodekit.eval.metric_path)."""

from decodekit.eval import diversity
from decodekit.eval.metrics import _module


class CompressionRatio(_module.FunctionMetric):
    function = staticmethod(diversity.compression_ratio)
    description = "Size of the texts over their gzip size; higher is more repetitive."
    result_name = "compression_ratio"
