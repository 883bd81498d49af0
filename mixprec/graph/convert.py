"""``mixprec.convert``: capture a model as an ATen graph and run the graph pass on it.

Design:

* Capture is ``torch.export`` (non-strict, the training IR). It was chosen over
  ``fx.symbolic_trace`` because it sees through Python control flow on real inputs, keeps
  high-level ops (``linear``, ``layer_norm``, ``scaled_dot_product_attention``) that the cast
  table names, records module paths for the report, supports a symbolic batch dimension, and is
  what third-party models (Hugging Face ``transformers``) are tested against upstream. The graph
  runs eagerly under autograd, so backward is derived from the rewritten forward and any
  optimizer trains it; ``torch.compile`` can take the result as is.
* The result, :class:`ConvertedModule`, owns the model's own submodules and parameters, so
  ``parameters()``, ``state_dict()`` (same keys, float32 at rest), ``.to()`` and optimizers work
  as on the original model. Train and eval graphs differ (dropout, batch norm), so each mode is
  captured on first use; so is each device. Parameter dtypes are read at every rewrite: after
  ``mixprec.initialize(converted, opt, "O2")`` stores weights in 16-bit the pass is re-run and
  the weight casts disappear.
* If the batch dimension cannot be symbolic (the model specializes on it), the capture falls
  back to one graph per input shape, with a warning that says so.
* Hugging Face models are captured with their key/value cache off (:mod:`mixprec.graph.caches`):
  torch.export cannot return the cache objects, and training does not use them.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from mixprec._core._warnings import MixprecWarning
from mixprec._core.policy import Policy, PolicyLike, as_policy, global_policy
from mixprec.graph import paint
from mixprec.graph.caches import no_cache, strip_use_cache
from mixprec.graph.report import PrecisionReport
from mixprec.graph.rewrite import PassResult, rewrite

__all__ = ["ConvertedModule", "capture", "convert"]

GRAPH_ATTR = "_mixprec_graph"


class CaptureError(RuntimeError):
    """torch.export could not capture the model."""


def _batch_spec(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    batch = torch.export.Dim("batch", min=1)

    def spec(x: Any) -> Any:
        return {0: batch} if isinstance(x, torch.Tensor) and x.dim() >= 1 else None

    return pytree.tree_map(spec, args), pytree.tree_map(spec, kwargs)


def capture(
    model: nn.Module, args: tuple, kwargs: dict | None = None, *, dynamic_batch: bool = True
) -> tuple[torch.fx.GraphModule, bool]:
    """``torch.export`` ``model`` on the example inputs; return (graph module, dynamic?)."""
    kwargs = kwargs or {}
    errors = []
    for dynamic in (True, False) if dynamic_batch else (False,):
        try:
            shapes = None
            if dynamic:
                a, k = _batch_spec(args, kwargs)
                shapes = {**dict(zip(_arg_names(model, len(args)), a)), **k} if k else a
            with no_cache(model):
                ep = torch.export.export(model, args, kwargs, dynamic_shapes=shapes, strict=False)
            return ep.module(), dynamic
        except Exception as e:  # noqa: BLE001 - reported below with the fix
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    raise CaptureError(
        f"mixprec.convert could not capture {type(model).__name__} with torch.export: "
        f"{errors[-1]}. Fix the capture by making control flow independent of tensor values "
        "(torch.cond, or move it out of forward), pass inputs the model accepts as "
        "example_inputs (a tuple of positional args; kwargs via example_kwargs), or train this "
        "model with the eager engine instead: mixprec.initialize(model, opt) or "
        "mixprec.autocast()."
    )


def _arg_names(model: nn.Module, n: int) -> list[str]:
    import inspect

    params = list(inspect.signature(model.forward).parameters)
    return params[:n]


def _tensors(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _rebind(gm: torch.fx.GraphModule, model: nn.Module) -> None:
    """Point the graph's parameter and buffer attributes at ``model``'s own tensors."""
    for fqn, t in _tensors(model):
        prefix, _, leaf = fqn.rpartition(".")
        try:
            owner = gm.get_submodule(prefix) if prefix else gm
        except AttributeError:
            continue
        if leaf in owner._parameters:
            owner._parameters[leaf] = t
        elif leaf in owner._buffers:
            owner._buffers[leaf] = t


class ConvertedModule(nn.Module):
    """A model whose forward runs the mixed-precision graph made by :func:`convert`."""

    def __init__(
        self,
        model: nn.Module,
        example: tuple[tuple, dict],
        policy: Policy,
        options: dict[str, Any],
        dynamic_batch: bool,
    ):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
        self.__dict__["_model"] = model
        self.__dict__[GRAPH_ATTR] = True
        self.policy = policy
        self.options = options
        self.dynamic_batch = dynamic_batch
        self._example = example
        self._captured: dict[Any, torch.fx.GraphModule] = {}
        self._graphs: dict[Any, tuple[torch.fx.GraphModule, PassResult]] = {}
        self._last: PassResult | None = None
        self.train(model.training)

    def extra_repr(self) -> str:
        return f"policy={self.policy}, model={type(self._model).__name__}"

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        first = next(iter(self._model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        shapes = None
        if not self.dynamic_batch:
            shapes = tuple(
                tuple(x.shape) if isinstance(x, torch.Tensor) else x
                for x in pytree.tree_leaves((args, kwargs))
            )
        return self.training, str(device), shapes

    def _graph(self, args: tuple, kwargs: dict) -> tuple[torch.fx.GraphModule, PassResult]:
        key = self._key(args, kwargs)
        dtypes = tuple(t.dtype for _, t in _tensors(self._model))
        entry = self._graphs.get((key, dtypes))
        if entry is not None:
            return entry
        pristine = self._captured.get(key)
        if pristine is None:
            self._model.train(self.training)  # the model's submodules are ours: same mode
            example = (args, kwargs) if self._captured or key[2] else self._example
            pristine, dynamic = capture(self._model, *example, dynamic_batch=self.dynamic_batch)
            if self.dynamic_batch and not dynamic:
                warnings.warn(
                    f"mixprec.convert: {type(self._model).__name__} specializes on its "
                    "batch size, so each new input shape is captured again. Make the "
                    "batch dimension symbolic-friendly or pass dynamic_batch=False to "
                    "silence this.",
                    MixprecWarning,
                    stacklevel=3,
                )
                self.dynamic_batch = False
                key = self._key(args, kwargs)
            self._captured[key] = pristine
        memo = {id(t): t for _, t in _tensors(pristine)}
        with warnings.catch_warnings():  # torch's own pytree spec deprecation, not ours
            warnings.simplefilter("ignore", FutureWarning)
            gm = copy.deepcopy(pristine, memo)
        _rebind(gm, self._model)
        result = rewrite(
            gm, self.policy.compute_dtype, output_dtype=self.policy.output_dtype, **self.options
        )
        self._graphs[(key, dtypes)] = (gm, result)
        return gm, result

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        kwargs = strip_use_cache(self._model, kwargs)
        gm, result = self._graph(args, kwargs)
        self._last = result
        return gm(*args, **kwargs)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The rewritten graph for the current mode (captured on the example inputs if needed)."""
        return self._graph(*self._example)[0]

    def precision_report(self) -> PrecisionReport:
        """Per-node dtypes, reasons and casts of the graph for the current mode."""
        gm, result = self._graph(*self._example)
        return PrecisionReport.build(gm, result)

    # state_dict keys are the original model's; the graph caches are not state
    def _apply(self, fn: Any, recurse: bool = True) -> ConvertedModule:
        out = super()._apply(fn, recurse)
        self._graphs.clear()
        return out


def _default_policy(policy: PolicyLike | None) -> Policy:
    if policy is not None:
        return as_policy(policy)
    g = global_policy()
    if g.compute_dtype != torch.float32:
        return g
    from mixprec._core.hardware import default_dtype

    return Policy("mixed_bfloat16" if default_dtype() == torch.bfloat16 else "mixed_float16")


def graph_settings(spec: Any) -> tuple[Policy, dict[str, Any]]:
    """The pass's policy and the Recipe fields it applies (``fp32_inside``, ``kernels``) from a
    :class:`~mixprec.Recipe`, or from a policy spelling (None: the default policy) with a
    Recipe's defaults, ``fp32_inside=False`` and ``kernels="auto"``: ``convert``, ``compile``
    and ``backend`` read a policy alike."""
    from mixprec.recipe import level_recipe

    recipe = level_recipe(spec)
    if recipe is not None:
        low = recipe.resolved_dtype()
        policy = Policy(
            param_dtype=torch.float32, compute_dtype=low, output_dtype=recipe.outputs or low
        )
        return policy, {"fp32_inside": recipe.fp32_inside, "kernels": recipe.kernels}
    return _default_policy(spec), {"fp32_inside": False, "kernels": "auto"}


def convert(
    model: nn.Module,
    example_inputs: Any,
    recipe: Any = None,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    dynamic_batch: bool = True,
    ops: Mapping[Any, str | None] | None = None,
    fp32_modules: Iterable[str] = (),
) -> ConvertedModule:
    """Capture ``model`` as a graph and rewrite it to mixed precision (the PAI-TAO design).

    Args:
        model: a float32 ``nn.Module``. Its submodules and parameters are shared, not copied.
        example_inputs: a tensor or a tuple of positional inputs for one forward call.
        recipe: a :class:`mixprec.Recipe` (its dtype, outputs, ``fp32_inside`` -- layer norm
            and softmax on 16-bit inputs, their kernels accumulate in float32 -- and
            ``kernels``), or a mixed policy (default: the global one if mixed, else
            ``mixed_bfloat16`` where bf16 is fast, ``mixed_float16`` otherwise).
        example_kwargs: keyword inputs for the example call.
        dynamic_batch: make dim 0 of every input symbolic (one graph for all batch sizes).
        ops: move ops between grappler's lists, e.g. ``{"gelu": "deny", "softmax": "infer"}``.
        fp32_modules: module paths (e.g. ``"blocks.0.attn"``) whose ops stay float32.

    Returns:
        A trainable :class:`ConvertedModule`; ``precision_report()`` explains every node.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert takes an nn.Module, received {type(model).__name__}.")
    if getattr(model, GRAPH_ATTR, False):
        raise ValueError("This model was already converted: convert the original model once.")
    from mixprec._core import engine

    if getattr(model, "_mixprec_level", None) or model.__dict__.get(engine.BOUNDARY_ATTR):
        raise ValueError(
            "convert the float32 model before mixprec.initialize: initialize "
            "installs the eager engine, which the graph pass replaces. Call "
            "convert(model, x) first, then initialize(converted, optimizer, recipe)."
        )
    pol, settings = graph_settings(recipe)
    fp32_inside = settings["fp32_inside"]
    if pol.compute_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"convert needs a 16-bit compute dtype; policy {pol} computes in "
            f"{pol.compute_dtype}. Use e.g. 'mixed_bfloat16' or 'mixed_float16'."
        )
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = strip_use_cache(model, dict(example_kwargs or {}))
    options = dict(
        fp32_inside=fp32_inside,
        ops=dict(ops or {}),
        fp32_modules=tuple(fp32_modules),
        kernels=settings["kernels"],
    )
    paint.build_lists(fp32_inside=fp32_inside, ops=ops)  # validate ops now, not at first call
    converted = ConvertedModule(model, (args, kwargs), pol, options, dynamic_batch)
    converted._graph(args, kwargs)  # capture now: errors surface at convert time
    return converted
