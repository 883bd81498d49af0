"""mixprec: automatic mixed-precision training for any PyTorch model, in one call.

Public names are re-exported here; everything else is internal.
"""

from mixprec.cast_table import cast_rules
from mixprec.cast_table import register_op
from mixprec.engine import autocast
from mixprec.graph import convert
from mixprec.footprint import Footprint
from mixprec.footprint import footprint
from mixprec.hardware import check
from mixprec.export import export
from mixprec.inference import for_inference
from mixprec.initialize import fp32_state_dict
from mixprec.initialize import initialize
from mixprec.initialize import scale_loss
import mixprec.clipping  # noqa: F401  (wraps torch.nn.utils.clip_grad_norm_)
from mixprec.lean import stochastic_round
from mixprec.norms import register_norm
from mixprec.keras import LossScaleOptimizer
from mixprec.loss_scale import LossScaler
from mixprec.optimizer import MixedPrecisionOptimizer
from mixprec.hardware import default_dtype
from mixprec.policy import Policy
from mixprec.policy import get_policy
from mixprec.policy import global_policy
from mixprec.policy import policy_scope
from mixprec.policy import set_global_policy
from mixprec.policy import set_policy
from mixprec.alignment import lint
from mixprec.locate import NonFiniteError
from mixprec.locate import NonFiniteLocator
from mixprec.locate import locate_nonfinite
from mixprec.opstats import OpStats
from mixprec.opstats import op_stats
from mixprec.range_audit import RangeAudit
from mixprec.range_audit import range_audit
from mixprec.tuning import TunePlan
from mixprec.tuning import tune

__version__ = "0.1.0"

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
