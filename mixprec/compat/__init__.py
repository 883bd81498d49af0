"""Compatibility layers that let code written for other mixed-precision APIs run on mixprec.

* :mod:`mixprec.compat.apex` -- NVIDIA Apex's ``amp`` namespace and ``FP16_Optimizer``
  (``from mixprec.compat.apex import amp``, or ``mixprec.compat.apex.install()`` to make an
  unchanged ``from apex import amp`` import mixprec), with its parts:
  :mod:`~mixprec.compat.amp_handle` (``amp.init()``), :mod:`~mixprec.compat.amp_casts` (user
  cast registrations), :mod:`~mixprec.compat.amp_checkpoint`, :mod:`~mixprec.compat.larc`
  (``apex.parallel.LARC``) and :mod:`~mixprec.compat.fp16_optimizer`.

The Keras-style ``LossScaleOptimizer`` lives in :mod:`mixprec.compat.keras`
(``mixprec.compat.keras.LossScaleOptimizer``).
"""
