"""Graph-rewrite mixed precision (the PAI-TAO / grappler design) on torch FX graphs.

:func:`convert` captures a model with torch.export and rewrites the graph; :func:`rewrite` runs
the pass on any FX graph; :func:`backend` applies it inside ``torch.compile``.
"""

from mixprec.graph.compile import backend, compile
from mixprec.graph.convert import ConvertedModule, convert
from mixprec.graph.report import PrecisionReport
from mixprec.graph.rewrite import rewrite

__all__ = ["ConvertedModule", "PrecisionReport", "backend", "compile", "convert", "rewrite"]
