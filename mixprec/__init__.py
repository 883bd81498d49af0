"""mixprec: automatic mixed-precision training for any PyTorch model, in one call.

Public names are re-exported here; everything else is internal.
"""

import sys as _sys

import torch.distributed as _dist

import mixprec.core.clipping  # makes torch.nn.utils.clip_grad_norm_ reach fp32 masters
from mixprec import _moved, amp
from mixprec.compat.keras import LossScaleOptimizer
from mixprec.core.activations import ActivationConfig
from mixprec.core.cast_table import cast_rules, register_op
from mixprec.core.engine import autocast, set_policy
from mixprec.core.footprint import Footprint, footprint
from mixprec.core.fp8.choice import FP8Plan
from mixprec.core.fp8.config import FP8Config
from mixprec.core.fp8.plan import fp8_plan
from mixprec.core.hardware import check, default_dtype
from mixprec.core.initialize import fp32_state_dict, initialize, scale_loss
from mixprec.core.lean import stochastic_round
from mixprec.core.loss_scale import LossScaler
from mixprec.core.norms import register_norm
from mixprec.core.optimizer import MixedPrecisionOptimizer
from mixprec.core.policy import Policy, get_policy, global_policy, policy_scope, set_global_policy
from mixprec.graph import convert
from mixprec.inference.export import export
from mixprec.inference.prepare import for_inference
from mixprec.numerics.alignment import lint
from mixprec.numerics.locate import NonFiniteError, NonFiniteLocator, locate_nonfinite
from mixprec.numerics.opstats import OpStats, op_stats
from mixprec.numerics.range_audit import RangeAudit, range_audit
from mixprec.numerics.tuning import TunePlan, tune

__version__ = "0.1.0"

if _dist.is_available():  # registers its plain-DDP hooks with the core
    import mixprec.distributed  # noqa: F401

_moved.install(_sys.modules[__name__])  # old flat module paths, with a DeprecationWarning

__all__ = [
    "ActivationConfig",
    "FP8Config",
    "FP8Plan",
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
    "amp",
    "autocast",
    "cast_rules",
    "check",
    "convert",
    "default_dtype",
    "export",
    "footprint",
    "for_inference",
    "fp8_plan",
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
