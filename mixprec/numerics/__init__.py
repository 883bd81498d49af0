"""Numerics tools: find, measure and fix what 16-bit does to a model's numbers.

* :mod:`~mixprec.numerics.locate` -- the first op that produced an inf/NaN (``locate_nonfinite``);
  its per-op checks in :mod:`~mixprec.numerics.nonfinite_ops`, its events in
  :mod:`~mixprec.numerics.nonfinite_event`;
* :mod:`~mixprec.numerics.opstats` -- per-op counts and dtypes under a policy (``op_stats``);
* :mod:`~mixprec.numerics.range_audit` -- value ranges against each 16-bit format
  (``range_audit``), with histograms from :mod:`~mixprec.numerics.range_plot`;
* :mod:`~mixprec.numerics.tuning` -- the fewest modules to keep in fp32 (``tune``): the search;
  its runs against fp32 in ``_tuner``, its result (``TunePlan``) in
  :mod:`~mixprec.numerics.tune_plan`;
* :mod:`~mixprec.numerics.alignment` -- dimensions that keep matmuls off the 16-bit units
  (``lint``);
* :mod:`~mixprec.numerics.report` -- ``mixprec report``: all of the above on one model.

``stochastic_round`` (the rounding of ``update="stochastic"``) and ``footprint`` (bytes per
parameter, counted from the tensors) are here too.
"""

from mixprec._core.cast_table import cast_rules
from mixprec._core.footprint import Footprint, footprint
from mixprec._core.update.rounding import stochastic_round
from mixprec.numerics.alignment import lint
from mixprec.numerics.locate import NonFiniteError, NonFiniteLocator, locate_nonfinite
from mixprec.numerics.opstats import OpStats, op_stats
from mixprec.numerics.range_audit import RangeAudit, range_audit
from mixprec.numerics.tuning import TunePlan, tune

__all__ = [
    "Footprint",
    "NonFiniteError",
    "NonFiniteLocator",
    "OpStats",
    "RangeAudit",
    "TunePlan",
    "cast_rules",
    "footprint",
    "lint",
    "locate_nonfinite",
    "op_stats",
    "range_audit",
    "stochastic_round",
    "tune",
]
