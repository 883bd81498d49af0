"""FSDP2 with mixprec: levels map onto ``fully_shard(..., mp_policy=MixedPrecisionPolicy)``.

Design (``docs/design.md``, "Distributed training"):

* **FSDP's fp32 shards are the master weights.** FSDP2 keeps each rank's parameter shard in
  fp32 and all-gathers it in ``param_dtype`` for forward and backward, so mixprec must not cast
  the parameters (O2/O3 ``initialize`` would) nor keep a second fp32 copy. The level's 16-bit
  compute dtype therefore becomes FSDP's ``param_dtype``; the gradient reduce-scatter runs in
  ``reduce_dtype`` (default: the same 16-bit dtype, the "16-bit communication" of the seed) and
  FSDP writes the reduced shard back as an fp32 gradient (a DTensor).
* mixprec then prepares the sharded model at **O1** (parameters untouched, no masters): its
  eager engine still applies the cast table inside the model (softmax, norms, losses in fp32;
  ``fp32_inside`` as at O2/O3), and its optimizer wrapper checks and unscales the fp32 DTensor
  gradient shards with the same fused kernel, which accepts DTensors on torch 2.13.
* O2 keeps norm layers in fp32 as it does without FSDP: each norm module becomes its own FSDP
  unit with an fp32 policy (one small extra all-gather and reduce-scatter per norm); O3 computes
  them from 16-bit copies. O3's memory saving (no masters) does not exist under FSDP.
* Each rank checks only its own shard, so an overflow is typically seen by one rank: the
  verdicts are reduced across the mesh (:func:`mixprec.distributed.sync_verdicts`).

| level | ``param_dtype`` | ``reduce_dtype`` (default) | norm units | mixprec level |
|---|---|---|---|---|
| O0 | fp32 | fp32 | - | O0 |
| O1 | fp32 | fp32 | - | O1 |
| O2 | 16-bit | 16-bit | fp32 | O1 (+ fp32_inside) |
| O3 | 16-bit | 16-bit | 16-bit | O1 (+ fp32_inside) |

Order: build the model, :func:`initialize_fsdp` (it shards, then builds the optimizer on the
sharded parameters through ``optimizer_fn``, then initializes mixprec).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from mixprec.core.hardware import default_dtype
from mixprec.core.initialize import _MARK, initialize, level_name
from mixprec.core.norms import is_norm
from mixprec.core.optimizer import MixedPrecisionOptimizer
from mixprec.core.policy import Policy, PolicyLike, as_policy
from mixprec.core.storage import restore_fp32
from mixprec.distributed.verdicts import require_process_group, sync_verdicts

__all__ = ["fsdp_mp_policy", "initialize_fsdp"]

_F32 = torch.float32
_LOW = (torch.float16, torch.bfloat16)


def fsdp_mp_policy(
    policy: PolicyLike, reduce_dtype: torch.dtype | None = None
) -> MixedPrecisionPolicy:
    """The FSDP2 ``MixedPrecisionPolicy`` for a mixprec policy.

    ``param_dtype`` is the policy's *compute* dtype (FSDP all-gathers the fp32 shards into it
    for compute), ``reduce_dtype`` defaults to it (16-bit gradient communication), and
    ``output_dtype`` is the policy's output dtype where it differs from the compute dtype.
    The policy's storage dtype has no FSDP counterpart: the shards stay fp32 (the masters).

    >>> fsdp_mp_policy("mixed_bfloat16")  # doctest: +SKIP
    MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                         output_dtype=torch.float32, cast_forward_inputs=True)
    """
    pol = as_policy(policy)
    compute = pol.compute_dtype if pol.compute_dtype != _F32 else None
    if reduce_dtype is not None and reduce_dtype not in (*_LOW, _F32):
        raise ValueError(
            f"reduce_dtype must be torch.bfloat16, torch.float16 or torch.float32, "
            f"received {reduce_dtype!r}."
        )
    output = pol.output_dtype if pol.output_dtype != pol.compute_dtype else None
    return MixedPrecisionPolicy(
        param_dtype=compute,
        reduce_dtype=reduce_dtype or compute,
        output_dtype=output,
        cast_forward_inputs=True,
    )


def _selected(model: nn.Module, units: Any) -> list[nn.Module]:
    if isinstance(units, (type, nn.Module)):
        units = (units,)
    units = tuple(units or ())
    classes = tuple(u for u in units if isinstance(u, type))
    instances = {id(u) for u in units if isinstance(u, nn.Module)}
    bad = [u for u in units if not isinstance(u, (type, nn.Module))]
    if bad:
        raise TypeError(f"units must be module classes or module instances, received {bad!r}.")
    return [
        m
        for m in model.modules()
        if m is not model and (isinstance(m, classes) or id(m) in instances)
    ]


def _check_model(model: nn.Module) -> None:
    if isinstance(model, DistributedDataParallel):
        raise TypeError(
            "initialize_fsdp received a DistributedDataParallel model: use either "
            "DDP (mixprec.distributed.wrap_ddp) or FSDP, on the bare module."
        )
    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
        raise RuntimeError(
            "This model is already sharded with fully_shard. Pass the unsharded "
            "model: initialize_fsdp shards it with the mixprec policy itself."
        )
    if model.__dict__.get(_MARK):
        raise RuntimeError(
            "mixprec.initialize was already called on this model; under FSDP "
            "call mixprec.distributed.initialize_fsdp instead (it initializes "
            "mixprec after sharding, so parameters stay fp32 masters)."
        )


def initialize_fsdp(
    model: nn.Module,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], Optimizer],
    level: str = "O2",
    dtype: torch.dtype | None = None,
    *,
    mesh: DeviceMesh | None = None,
    units: type | nn.Module | Sequence[type | nn.Module] = (),
    reduce_dtype: torch.dtype | None = None,
    keep_norm_fp32: bool | None = None,
    reshard_after_forward: bool | None = None,
    **overrides: Any,
) -> tuple[nn.Module, MixedPrecisionOptimizer]:
    """Shard ``model`` with FSDP2 at a mixprec level and return ``(model, optimizer)``.

    Args:
        model: an unsharded, uninitialized module (on its device).
        optimizer_fn: builds the optimizer from the sharded parameters, e.g.
            ``lambda params: torch.optim.AdamW(params, lr=3e-4)``.
        level: "O0"-"O3" (see the module docstring's table).
        dtype: the 16-bit dtype; None picks :func:`mixprec.default_dtype` for the device.
        mesh: a 1-D device mesh (default: all ranks, on the parameters' device type).
        units: module classes or instances that become their own FSDP units (e.g. the
            transformer block class); the root is always one.
        reduce_dtype: dtype of the gradient reduce-scatter (default: see the table).
        keep_norm_fp32: norm layers as fp32 units (default: True at O2, else False).
        reshard_after_forward: passed to ``fully_shard``.
        **overrides: passed to :func:`mixprec.initialize` (``loss_scale``, ``init_scale``,
            ``growth_interval``, ``num_losses``, ``kernels``, ...).

    Returns:
        The sharded model (modified in place) and a ``MixedPrecisionOptimizer`` whose
        verdicts are reduced over the mesh.
    """
    require_process_group("initialize_fsdp")
    _check_model(model)
    level = level_name(level)
    if "master_weights" in overrides:
        raise ValueError(
            "master_weights does not apply under FSDP: FSDP's fp32 parameter shards "
            "are the master weights."
        )
    if not callable(optimizer_fn) or isinstance(optimizer_fn, Optimizer):
        raise TypeError(
            "optimizer_fn must build the optimizer from the sharded parameters, e.g. "
            "lambda params: torch.optim.AdamW(params, lr=3e-4); received "
            f"{type(optimizer_fn).__name__}. (fully_shard replaces the parameters, "
            "so an optimizer built before it would hold stale ones.)"
        )
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    if level == "O0":
        dtype = _F32
    elif dtype is None:
        dtype = default_dtype(device)
    elif dtype not in _LOW:
        raise ValueError(
            f"Level {level} needs torch.bfloat16 or torch.float16, received "
            f"{dtype!r}; use level='O0' for float32."
        )
    if keep_norm_fp32 is None:
        keep_norm_fp32 = level == "O2"
    elif keep_norm_fp32 and level not in ("O2", "O3"):
        raise ValueError(
            f"keep_norm_fp32 only applies where the compute dtype of parameters is "
            f"16-bit (O2, O3); level {level} computes them in float32."
        )
    low_params = level in ("O2", "O3")
    policy = fsdp_mp_policy(
        Policy(compute_dtype=dtype if low_params else _F32), reduce_dtype=reduce_dtype
    )
    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    common: dict[str, Any] = dict(mesh=mesh)
    if reshard_after_forward is not None:
        common["reshard_after_forward"] = reshard_after_forward

    # FSDP's fp32 shards are the master weights at every level: a model that arrives cast to
    # 16 bits gets fp32 parameters back before it is sharded, with initialize's one warning
    restore_fp32(model, level, dtype, {"cast_params": False, "keep_norm_fp32": False})
    if keep_norm_fp32:
        norm_policy = MixedPrecisionPolicy(reduce_dtype=_F32, cast_forward_inputs=False)
        for m in [m for m in model.modules() if is_norm(m) and m is not model]:
            if any(True for _ in m.parameters()):
                fully_shard(m, mp_policy=norm_policy, **common)
    for m in reversed(_selected(model, units)):  # innermost first
        fully_shard(m, mp_policy=policy, **common)
    fully_shard(model, mp_policy=policy, **common)

    optimizer = optimizer_fn(model.parameters())
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer_fn returned {type(optimizer).__name__}, expected a torch.optim.Optimizer."
        )
    if level in ("O2", "O3"):
        overrides.setdefault("fp32_inside", True)
    model.__dict__["_mixprec_fsdp"] = True  # sharded here, to match: initialize accepts it
    model, opt = initialize(
        model,
        optimizer,
        level="O0" if level == "O0" else "O1",
        dtype=None if level == "O0" else dtype,
        **overrides,
    )
    sync_verdicts(opt, mesh.get_group())
    return model, opt
