"""mixprec: automatic mixed-precision training for any PyTorch model, in one call.

Public names are re-exported here; everything else is internal.
"""

from mixprec.core.cast_table import cast_rules
from mixprec.core.cast_table import register_op
from mixprec.core.engine import autocast
from mixprec.graph import convert
from mixprec.core.footprint import Footprint
from mixprec.core.footprint import footprint
from mixprec.core.hardware import check
from mixprec.inference.export import export
from mixprec.inference.prepare import for_inference
from mixprec.core.initialize import fp32_state_dict
from mixprec.core.initialize import initialize
from mixprec.core.initialize import scale_loss
import mixprec.core.clipping  # noqa: F401  (wraps torch.nn.utils.clip_grad_norm_)
from mixprec.core.lean import stochastic_round
from mixprec.core.norms import register_norm
from mixprec.compat.keras import LossScaleOptimizer
from mixprec.core.loss_scale import LossScaler
from mixprec.core.optimizer import MixedPrecisionOptimizer
from mixprec.core.hardware import default_dtype
from mixprec.core.policy import Policy
from mixprec.core.policy import get_policy
from mixprec.core.policy import global_policy
from mixprec.core.policy import policy_scope
from mixprec.core.policy import set_global_policy
from mixprec.core.engine import set_policy
from mixprec.numerics.alignment import lint
from mixprec.numerics.locate import NonFiniteError
from mixprec.numerics.locate import NonFiniteLocator
from mixprec.numerics.locate import locate_nonfinite
from mixprec.numerics.opstats import OpStats
from mixprec.numerics.opstats import op_stats
from mixprec.numerics.range_audit import RangeAudit
from mixprec.numerics.range_audit import range_audit
from mixprec.numerics.tuning import TunePlan
from mixprec.numerics.tuning import tune

__version__ = "0.1.0"

import sys as _sys

import torch.distributed as _dist

from mixprec import _moved

if _dist.is_available():  # registers its plain-DDP hooks with the core
    import mixprec.distributed  # noqa: F401

_moved.install(_sys.modules[__name__])  # old flat module paths, with a DeprecationWarning

__all__ = [
    "Footprint",
    "LossScaleOptimizer",
    "LossScaler",
    "MixedPrecisionOptimizer",
    "NonFiniteError",
    "NonFiniteLocator",
    "OpStats",
    "Policy",
    "RangeAudit",
    "TunePlan",
    "autocast",
    "cast_rules",
    "check",
    "convert",
    "default_dtype",
    "export",
    "footprint",
    "for_inference",
    "fp32_state_dict",
    "get_policy",
    "global_policy",
    "initialize",
    "lint",
    "locate_nonfinite",
    "op_stats",
    "policy_scope",
    "range_audit",
    "register_norm",
    "register_op",
    "scale_loss",
    "set_global_policy",
    "set_policy",
    "stochastic_round",
    "tune",
]
