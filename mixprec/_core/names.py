"""The words a :class:`~mixprec.Recipe`'s fields take, spelled once, at the bottom of the house:
the recipe and its rules import them, and so may any module that reads those fields."""

from __future__ import annotations

__all__ = ["FLAGS", "GRADIENTS", "LEVELS", "UPDATE_MODES"]

#: Apex's optimization levels, the presets every named recipe starts from
LEVELS = ("O0", "O1", "O2", "O3")
#: how an update mode writes the fp32 result into 16-bit weights (``update=``; None and "auto"
#: are the recipe's other values)
UPDATE_MODES = ("nearest", "kahan", "stochastic")
#: ``gradients=``: held until ``zero_grad``, released in backward, decided by the first step, or
#: coded in 8 bits as they complete
GRADIENTS = ("held", "released", "auto", "coded")
#: the Recipe's True/False fields
FLAGS = ("masters", "frozen_masters", "cast_inputs", "fp32_inside")
