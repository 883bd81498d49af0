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
  them from 16-bit copies, with their running statistics stored 16-bit as ``initialize`` stores
  them (FSDP casts parameters, not buffers). O3's memory saving (no masters) does not exist
  under FSDP.
* Each rank checks only its own shard, so an overflow is typically seen by one rank: the
  verdicts are reduced across the mesh (:func:`mixprec.distributed.sync_verdicts`).
* **Update modes shard the 16-bit weights themselves** (a recipe naming ``update``, e.g.
  ``"lean"`` or ``Recipe("O3", update="kahan")``): there are no masters to keep, so the model is
  cast as ``initialize`` casts it *before* it is sharded, FSDP all-gathers the 16-bit shards as
  they are (``param_dtype`` None) and reduce-scatters gradients in the recipe's
  ``reduce_dtype``, and the update mode steps each rank's shard through its local tensor, with
  optimizer states (8-bit codes included: their blocks run along rows, so a dim-0 shard
  quantizes as the whole tensor does) per shard. Stochastic rounding is keyed by each element's
  index in the whole parameter, so the shards round as one tensor would. Gradients are held:
  FSDP writes the reduce-scattered gradient after autograd's hooks have run, so they cannot be
  released in backward (``gradients="auto"`` holds them; ``"released"`` is refused).

| level | ``param_dtype`` | ``reduce_dtype`` (default) | norm units | mixprec level |
|---|---|---|---|---|
| O0 | fp32 | fp32 | - | O0 |
| O1 | fp32 | fp32 | - | O1 |
| O2 | 16-bit | 16-bit | fp32 | O1 (+ fp32_inside) |
| O3 | 16-bit | 16-bit | 16-bit | O1 (+ fp32_inside) |
| update modes (``"lean"``) | None (16-bit shards) | 16-bit | as the recipe keeps | the recipe |

FP8 recipes: a tensorwise FP8 layer's weight is all-gathered in FP8, cast on each rank with the
whole weight's scale (:mod:`mixprec.distributed.fp8_gather`); rowwise weights gather in
``param_dtype`` as above.

Order: build the model, :func:`initialize_fsdp` (it shards, then builds the optimizer on the
sharded parameters through ``optimizer_fn``, then initializes mixprec).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from mixprec._core.norms import is_norm
from mixprec._core.optimizer import MixedPrecisionOptimizer
from mixprec._core.policy import Policy, PolicyLike, as_policy
from mixprec._core.storage import cast_buffers, cast_storage, restore_fp32
from mixprec._core.update.rounding import shard_offset
from mixprec._initialize import _MARK, initialize
from mixprec.distributed import meta_init
from mixprec.distributed.fp8_gather import gather_in_fp8
from mixprec.distributed.verdicts import require_process_group, sync_verdicts
from mixprec.recipe import Recipe, as_recipe

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
    recipe: Recipe | str = "O2",
    dtype: torch.dtype | None = None,
    *,
    mesh: DeviceMesh | None = None,
    units: type | nn.Module | Sequence[type | nn.Module] = (),
    reshard_after_forward: bool | None = None,
) -> tuple[nn.Module, MixedPrecisionOptimizer]:
    """Shard ``model`` with FSDP2 under a recipe and return ``(model, optimizer)``.

    Args:
        model: an unsharded, uninitialized module: on its device, or built under
            ``torch.device("meta")`` so no rank holds the whole model (its modules'
            ``reset_parameters()`` then fill each rank's shards; see
            :mod:`mixprec.distributed.meta_init`).
        optimizer_fn: builds the optimizer from the sharded parameters, e.g.
            ``lambda params: torch.optim.AdamW(params, lr=3e-4)``.
        recipe: a :class:`mixprec.Recipe` or name (see the module docstring's table); its
            ``reduce_dtype`` is the gradient reduce-scatter's dtype and ``keep_fp32="norms"``
            makes norm layers fp32 units.
        dtype: the 16-bit dtype; None: the recipe's, else :func:`mixprec.default_dtype`.
        mesh: a 1-D device mesh (default: all ranks, on the parameters' device type).
        units: module classes or instances that become their own FSDP units (e.g. the
            transformer block class); the root is always one.
        reshard_after_forward: passed to ``fully_shard``.

    Returns:
        The sharded model (modified in place) and a ``MixedPrecisionOptimizer`` whose
        verdicts are reduced over the mesh.
    """
    require_process_group("initialize_fsdp")
    _check_model(model)
    if not callable(optimizer_fn) or isinstance(optimizer_fn, Optimizer):
        raise TypeError(
            "optimizer_fn must build the optimizer from the sharded parameters, e.g. "
            "lambda params: torch.optim.AdamW(params, lr=3e-4); received "
            f"{type(optimizer_fn).__name__}. (fully_shard replaces the parameters, "
            "so an optimizer built before it would hold stale ones.)"
        )
    first = next(model.parameters(), None)
    meta = meta_init.is_meta(model)  # built on the meta device: filled shard by shard
    if meta:
        meta_init.check(model)
        device = meta_init.device_for(mesh.device_type if mesh is not None else None)
    else:
        device = first.device if first is not None else torch.device("cpu")
    recipe = _fsdp_recipe(as_recipe(recipe, dtype))
    low = recipe.resolved_dtype(device)
    if recipe.reduce_dtype == "auto":  # FSDP's: the gathered parameters' dtype (fp32 at O0, O1)
        recipe = recipe.replace(reduce_dtype=low if recipe.weights == "16-bit" else torch.float32)
    recipe = recipe.resolve(device)  # every other "auto", once
    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    common: dict[str, Any] = dict(mesh=mesh)
    if reshard_after_forward is not None:
        common["reshard_after_forward"] = reshard_after_forward
    modes = _update_mode(recipe)
    fp32_values = _cast_16bit(model, recipe, low) if modes else {}
    _shard(model, recipe, low, units, common, modes)
    if meta:  # the fp32 values: each 16-bit shard's own rows, made as it is filled
        fp32_values = meta_init.materialize(model, device, keep=bool(fp32_values))
    optimizer = optimizer_fn(model.parameters())
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer_fn returned {type(optimizer).__name__}, expected a torch.optim.Optimizer."
        )
    model.__dict__["_mixprec_fsdp"] = True  # sharded here, to match: initialize accepts it
    model.__dict__["_mixprec_fsdp_recipe"] = (recipe, low)  # what its checkpoints record
    inner = recipe.replace(gradients="held") if modes else _inner_recipe(recipe)
    model, opt = initialize(model, optimizer, inner, low)
    gather_in_fp8(model, recipe.fp8)  # tensorwise FP8 layers: their weights gathered in FP8
    if opt.updater is not None and opt.updater.compensation:
        _start_compensation(model, opt, fp32_values)
    sync_verdicts(opt, mesh.get_group())
    return model, opt


def _update_mode(recipe: Recipe) -> bool:
    """Whether the recipe names an update mode: 16-bit shards stepped without masters."""
    return recipe.update not in ("auto", None)


def _fsdp_recipe(recipe: Recipe) -> Recipe:
    """The recipe, refused where FSDP cannot do what it says."""
    if not _update_mode(recipe):
        if recipe.optimizer_states != "auto":
            raise ValueError(
                f"Recipe {str(recipe)!r}: optimizer_states apply to an update mode (16-bit "
                "weights without masters); name one, e.g. update='kahan' or the 'lean' recipe, "
                "or drop optimizer_states (the fp32 shards are then the master weights)."
            )
        return recipe
    if recipe.gradients in ("released", "coded"):
        raise ValueError(
            f"Recipe {str(recipe)!r}: gradients={recipe.gradients!r} takes each gradient in "
            "backward, "
            "but FSDP2 writes the reduce-scattered gradient shards after autograd's hooks have "
            "run. Use gradients='held' (or 'auto', which holds them under FSDP)."
        )
    return recipe


def _cast_16bit(model: nn.Module, recipe: Recipe, low: torch.dtype) -> dict[str, Tensor]:
    """Cast the unsharded model as ``initialize`` casts it for the recipe (norms fp32 where it
    keeps them); returns the pre-cast fp32 values by parameter name where ``"kahan"`` starts
    its compensation from them."""
    restore_fp32(model, recipe, low)
    keep = {id(p) for p in model.parameters()} if recipe.update == "kahan" else set()
    kept: dict[int, Tensor] = {}
    cast_storage(model, low, recipe.keep_fp32, keep, kept)
    return {name: kept[id(p)] for name, p in model.named_parameters() if id(p) in kept}


@torch.no_grad()
def _start_compensation(
    model: nn.Module, opt: MixedPrecisionOptimizer, fp32_values: dict[str, Tensor]
) -> None:
    """Kahan compensation of each shard starts from the residual of its pre-cast fp32 rows, as
    ``initialize`` starts it for an unsharded model."""
    for name, p in model.named_parameters():
        comp, value = opt.updater.compensation.get(p), fp32_values.get(name)
        if comp is None or value is None:
            continue
        start = 0 if value.numel() == comp.numel() else shard_offset(p)  # a shard's own rows
        rows = value.reshape(-1)[start : start + comp.numel()].view(comp.shape)
        local = p.to_local() if hasattr(p, "to_local") else p
        comp.copy_((rows.float() - local.float()).to(comp.dtype))


def _shard(
    model: nn.Module,
    recipe: Recipe,
    low: torch.dtype,
    units: Any,
    common: dict[str, Any],
    modes: bool = False,
) -> None:
    """fully_shard the norm units (fp32, where the recipe keeps norms fp32), the chosen units
    innermost first, then the root, with the recipe's parameter and reduce dtypes; with an
    update mode (``modes``) the parameters are already 16-bit and are gathered as they are."""
    low_params = recipe.weights == "16-bit"
    reduce = recipe.reduce_dtype  # resolved by initialize_fsdp
    policy = fsdp_mp_policy(Policy(compute_dtype=low if low_params else _F32), reduce_dtype=reduce)
    if modes:  # the 16-bit shards are the weights: all-gathered as stored
        policy = MixedPrecisionPolicy(
            param_dtype=None,
            reduce_dtype=reduce or low,
            output_dtype=policy.output_dtype,
            cast_forward_inputs=True,
        )
    else:  # FSDP's fp32 shards are the master weights: a model that arrives cast to 16 bits
        # gets fp32 parameters back before it is sharded, with initialize's one warning
        restore_fp32(model, recipe, low, weights="fp32")
        if low_params and recipe.keep_fp32 != "norms":
            # O3: norms compute from 16-bit gathered weights, and batch_norm refuses 16-bit
            # weights beside fp32 running statistics; FSDP casts parameters, not buffers, so the
            # norms' buffers are stored 16-bit here, as initialize stores them
            for m in model.modules():
                if is_norm(m):
                    cast_buffers(m, low)
    if low_params and recipe.keep_fp32 == "norms":
        norm_policy = MixedPrecisionPolicy(reduce_dtype=_F32, cast_forward_inputs=False)
        for m in [m for m in model.modules() if is_norm(m) and m is not model]:
            if any(True for _ in m.parameters()):
                fully_shard(m, mp_policy=norm_policy, **common)
    for m in reversed(_selected(model, units)):  # innermost first
        fully_shard(m, mp_policy=policy, **common)
    fully_shard(model, mp_policy=policy, **common)


def _inner_recipe(recipe: Recipe) -> Recipe:
    """What mixprec.initialize applies to the sharded model: O1 (FSDP casts the parameters),
    with ``fp32_inside`` at O2/O3 and the recipe's scaling, FP8, activations and outputs."""
    if recipe.compute == "fp32":
        return Recipe("O0", outputs=recipe.outputs, num_losses=recipe.num_losses)
    return Recipe(
        "O1",
        fp32_inside=recipe.weights == "16-bit" or recipe.fp32_inside,
        loss_scale=recipe.loss_scale,
        num_losses=recipe.num_losses,
        kernels=recipe.kernels,
        fp8=recipe.fp8,
        activations=recipe.activations,
        outputs=recipe.outputs,
    )
