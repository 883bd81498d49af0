"""Inference: a trained model served in mixed precision, exported, or stored in int8.

* :mod:`~mixprec.inference.prepare` -- ``for_inference``: an eval-mode mixed-precision model;
* :mod:`~mixprec.inference.export` -- ``export`` to ONNX or a ``torch.export`` program, casts
  stored in the graph by the precision pass of :mod:`~mixprec.inference.onnx_pass`
  (``mix_onnx``);
* :mod:`~mixprec.inference.quantize` -- int8 storage for chosen Linear/Conv layers;
* :mod:`~mixprec.inference.bench` -- latency, throughput and accuracy of each way to serve, on the
  workloads of :mod:`~mixprec.inference.bench_workloads`.
"""

from mixprec.inference.export import export
from mixprec.inference.prepare import for_inference

__all__ = ["export", "for_inference"]
