"""FP8 in one package: matmuls for chosen ``nn.Linear`` layers (the ``fp8=`` option) and the
quantization they share with FP8 activations; see ``docs/fp8.md``.

Design: one place per concept, imported one way (each module only from those above it here):

* :mod:`~mixprec.fp8.quantization` -- amax, scales and casts that never hide an overflow,
  shared with the FP8 copies of saved activations (``activations="fp8"``);
* :mod:`~mixprec.fp8.config` -- :class:`FP8Config` (recipe, layers, target GPU) and each
  recipe's :class:`Scaling` (formats and scale granularity), as data;
* :mod:`~mixprec.fp8.gemm` -- one ``torch._scaled_mm`` held to CUDA's rules on every device;
* :mod:`~mixprec.fp8.gathered` -- :class:`GatheredFP8Weight`: a weight that FSDP2 all-gathered
  in FP8 (bytes and one scale), taken by the FP8 linear as it is;
* :mod:`~mixprec.fp8.linear` -- :func:`fp8_linear`: a Linear's three GEMMs in FP8;
* :mod:`~mixprec.fp8.choice` -- per layer, FP8 or 16-bit and why: the roofline (speed) and
  the casts' numbers; :class:`FP8Choice`, :class:`FP8Plan`;
* :mod:`~mixprec.fp8.layers` -- which Linears of a model run in FP8, and their forward;
* :mod:`~mixprec.fp8.plan` -- :func:`fp8_plan`: the choice ahead of training.

The engine and ``initialize`` call into :mod:`~mixprec.fp8.layers`; nothing here imports them.
"""

from mixprec.fp8.choice import FP8Choice, FP8Plan
from mixprec.fp8.config import RECIPES, FP8Config, Scaling
from mixprec.fp8.linear import fp8_linear
from mixprec.fp8.plan import fp8_plan

__all__ = ["RECIPES", "FP8Choice", "FP8Config", "FP8Plan", "Scaling", "fp8_linear", "fp8_plan"]
