"""mixprec: automatic mixed-precision training for any PyTorch model, in one call.

    model, opt = mixprec.initialize(model, opt, "O2", torch.bfloat16)

A :class:`Recipe` states how every tensor of a training step is held and computed; a
:class:`Policy` the three dtypes of one module. The names here apply them; the tools live in
subpackages: :mod:`mixprec.numerics` (find and fix numerical problems), :mod:`mixprec.graph`
(the automatic graph pass), :mod:`mixprec.inference`, :mod:`mixprec.distributed`,
:mod:`mixprec.compat` (Apex, Keras) and :mod:`mixprec.amp` (``torch.amp``'s API).

Importing mixprec changes nothing in torch: mixprec's registrations happen when a mixprec
region or an initialized model first runs.
"""

import torch.distributed as _dist

from mixprec import amp, graph, inference, numerics, warnings  # noqa: F401 - mixprec.numerics.tune
from mixprec._core.activations import ActivationConfig
from mixprec._core.cast_table import register_op
from mixprec._core.engine import autocast, set_policy
from mixprec._core.fp32_values import fp32_state_dict
from mixprec._core.hardware import check, default_dtype
from mixprec._core.norms import register_norm
from mixprec._core.optimizer import scale_loss
from mixprec._core.policy import Policy, get_policy, global_policy, policy_scope, set_global_policy
from mixprec._initialize import initialize
from mixprec.fp8.config import FP8Config
from mixprec.graph import convert
from mixprec.inference import for_inference
from mixprec.recipe import LossScaling, Recipe

__version__ = "0.1.0"

if _dist.is_available():  # registers its plain-DDP hooks with the core
    import mixprec.distributed  # noqa: F401

__all__ = [
    "ActivationConfig",
    "FP8Config",
    "LossScaling",
    "Policy",
    "Recipe",
    "autocast",
    "check",
    "convert",
    "default_dtype",
    "for_inference",
    "fp32_state_dict",
    "get_policy",
    "global_policy",
    "initialize",
    "policy_scope",
    "register_norm",
    "register_op",
    "scale_loss",
    "set_global_policy",
    "set_policy",
]
