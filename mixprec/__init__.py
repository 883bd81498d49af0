"""mixprec: automatic mixed-precision training for any PyTorch model, in one call.

Public names are re-exported here; everything else is internal.
"""

from mixprec.cast_table import cast_rules
from mixprec.cast_table import register_op
from mixprec.engine import autocast
from mixprec.hardware import check
from mixprec.initialize import fp32_state_dict
from mixprec.initialize import initialize
from mixprec.initialize import scale_loss
from mixprec.loss_scale import LossScaler
from mixprec.optimizer import MixedPrecisionOptimizer
from mixprec.hardware import default_dtype
from mixprec.policy import Policy
from mixprec.policy import get_policy
from mixprec.policy import global_policy
from mixprec.policy import policy_scope
from mixprec.policy import set_global_policy
from mixprec.policy import set_policy

__version__ = "0.1.0"

__all__ = [
    "LossScaler",
    "MixedPrecisionOptimizer",
    "Policy",
    "autocast",
    "cast_rules",
    "check",
    "default_dtype",
    "fp32_state_dict",
    "get_policy",
    "global_policy",
    "initialize",
    "policy_scope",
    "register_op",
    "scale_loss",
    "set_global_policy",
    "set_policy",
]
