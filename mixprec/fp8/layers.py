"""Which ``nn.Linear`` layers of a model run in FP8, and the forward they run.

Design:

* **The module stays an ``nn.Linear``.** A chosen layer gets an instance-level ``forward``
  (:class:`FP8Forward`, as the engine's module boundaries do): the class, the parameters and
  ``state_dict`` are untouched, so ``fp32_state_dict`` loads into the plain model and a layer
  whose turn never comes runs ``nn.Linear.forward`` itself. Only exact ``nn.Linear`` forwards
  are candidates: a subclass with its own forward (LoRA, quantized layers) means something
  else by it.
* **Candidates.** ``"all"`` and ``"auto"`` leave out the output head (the model's last
  ``nn.Linear``, and any Linear sharing its weight with an embedding) and any Linear with its
  own policy (``set_policy``, :func:`mixprec.numerics.tune`'s plan). A predicate decides by
  itself. The
  shape rule of :mod:`.gemm` applies to all.
* **When "auto" decides.** The speed side needs the number of tokens M and the numbers side a
  real batch, which ``initialize`` does not have: a candidate decides at its first forward,
  from its own input, and keeps the choice. ``mixprec.fp8.fp8_plan(model, batch)`` makes the same
  choices ahead of time; ``FP8Config(layers=plan)`` then applies them as they are (the way to
  resume with the same layers). Under ``torch.compile`` a layer still undecided is judged by
  its shape alone: a compiled graph has no values to measure, and a graph break inside a
  mixprec region is avoided. Decide first (``fp8_plan``, or one eager step) to have both sides.
  Once every layer has decided, a model where none runs in FP8 gets one warning: before the
  first step the plan only said "pending", and no FP8 at all is not what ``fp8=`` asked for.
* **Devices.** CUDA below compute capability 8.9 has no FP8 tensor cores: refused, naming the
  GPU. On a CPU the GEMMs run torch's reference ``_scaled_mm`` (emulated, slow): a one-time
  warning. On CUDA, FP8 outside ``torch.compile`` fuses none of its casts: a one-time warning.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import warnings
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec._core._warnings import user_stacklevel
from mixprec._core.hardware import MixprecPerformanceWarning, fp8_support
from mixprec._core.policy import POLICY_ATTR
from mixprec.fp8.choice import (
    MIN_SPEEDUP,
    FP8Choice,
    FP8Plan,
    decide,
    gpu_for_name,
    predicted_speedup,
)
from mixprec.fp8.config import FP8Config
from mixprec.fp8.gemm import layer_shape_ok
from mixprec.fp8.linear import fp8_linear

__all__ = [
    "FP8_ATTR",
    "REGISTRY_ATTR",
    "FP8Forward",
    "FP8Layer",
    "candidates",
    "enter_region",
    "exit_region",
    "layers_of",
    "prepare",
]

FP8_ATTR = "_mixprec_fp8"  # on a chosen (or pending) Linear: its FP8Layer
REGISTRY_ATTR = "_mixprec_fp8_layers"  # on the model: {name: FP8Layer} for every Linear judged
_LOW = (torch.bfloat16, torch.float16)


class FP8Layer:
    """One Linear's FP8 state: its recipe, the GPU its speed is judged for, and its choice
    (None while ``"auto"`` waits for the first batch)."""

    def __init__(self, name: str, config: FP8Config, target: str, source: str) -> None:
        self.name = name
        self.recipe = config.scaling
        self.target = target
        self.source = source  # "initialize" or "region" (mixprec.autocast(fp8=...))
        self.choice: FP8Choice | None = None
        self.verdict: _Verdict | None = None  # shared by the layers of one prepare()

    @property
    def fp8(self) -> bool:
        """Chosen for FP8."""
        return self.choice is not None and self.choice.fp8

    @property
    def active(self) -> bool:
        """Running in FP8 now (a layer chosen by ``autocast(fp8=...)`` only in such a region)."""
        return self.fp8 and (self.source != "region" or _region_active())

    def current(self) -> FP8Choice:
        """The choice, or a pending one."""
        if self.choice is not None:
            return self.choice
        return FP8Choice(
            self.name,
            False,
            f"pending: decided from its first batch (layers='auto', {self.recipe.name})",
            target=self.target,
            pending=True,
        )

    def __repr__(self) -> str:
        return f"FP8Layer({self.name!r}, {self.recipe.name}, {self.current().reason!r})"


class FP8Forward:
    """``nn.Linear.forward`` with the three GEMMs in FP8 while the layer's choice says so."""

    def __init__(self, module: nn.Linear, layer: FP8Layer) -> None:
        self.module = module
        self.layer = layer

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(nn.Linear.forward.__get__(self.module))

    def __call__(self, input: Tensor) -> Tensor:
        module, layer = self.module, self.layer
        if layer.choice is None and torch.compiler.is_compiling():
            # no values while tracing, and a graph break inside a mixprec region is to be
            # avoided: an undecided layer is judged by its shape alone (and stays undecided)
            fp8 = _fast_enough(layer, input, module.weight)
            run = fp8 and (layer.source != "region" or _region_active())
        else:
            if layer.choice is None:
                _decide_now(layer, input, module.weight)
            run = layer.active
        if not run:
            return F.linear(input, module.weight, module.bias)
        if input.is_cuda and not torch.compiler.is_compiling():
            _warn_eager_cuda()
        return fp8_linear(input, module.weight, module.bias, layer.recipe, _out_dtype(input))


def _decide_now(layer: FP8Layer, x: Tensor, weight: Tensor) -> None:
    """The ``"auto"`` decision from a layer's first input (it reads values).

    Under torch.distributed each rank judges its own batch: the verdicts are reduced (FP8 only
    where every rank says so), so all ranks run the same layers in FP8. Every rank reaches a
    layer's first forward in the same order, so the collectives match."""
    choice = decide(layer.name, layer.recipe, x, weight, layer.target)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([1.0 if choice.fp8 else 0.0], device=x.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if choice.fp8 and not flag.item():
            choice = dataclasses.replace(
                choice, fp8=False, reason=f"another rank's batch kept it 16-bit ({choice.reason})"
            )
    layer.choice = choice
    if layer.verdict is not None:
        layer.verdict.check()


def _fast_enough(layer: FP8Layer, x: Tensor, weight: Tensor) -> bool:
    """The speed side of the choice alone (shapes only: traceable)."""
    n, k = weight.shape
    return predicted_speedup(x.numel() // k, k, n, layer.target, layer.recipe.name) >= MIN_SPEEDUP


def _out_dtype(x: Tensor) -> torch.dtype:
    """A 16-bit input keeps its dtype; a float32 input inside a 16-bit region (O1) takes the
    region's dtype, as the 16-bit Linear it replaces would."""
    if x.dtype in _LOW:
        return x.dtype
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


_warned: set[str] = set()


def _warn_eager_cuda() -> None:
    if "eager" in _warned:
        return
    _warned.add("eager")
    warnings.warn(
        "FP8 layers are running outside torch.compile on CUDA: eager FP8 launches a kernel for "
        "every amax, scale and cast and is usually slower than bf16. Compile the model "
        "(model = torch.compile(model)) to fuse them.",
        MixprecPerformanceWarning,
        stacklevel=3,
    )


def check_device(device: torch.device) -> None:
    """Refuse a device without FP8 GEMMs; warn once that a CPU emulates them."""
    support = fp8_support(device)
    if not support.supported:
        raise RuntimeError(f"fp8= cannot run here: {support.reason}.")
    if device.type == "cpu" and "cpu" not in _warned:
        _warned.add("cpu")
        warnings.warn(
            "FP8 on CPU is emulated (torch's reference _scaled_mm, slower than bf16): use it "
            "for tests and development. Layers are chosen for an H100 unless "
            "FP8Config(target=...) says otherwise.",
            MixprecPerformanceWarning,
            stacklevel=user_stacklevel(),
        )


def default_target(device: torch.device, config: FP8Config) -> str:
    """The GPU the speed side is judged for: the config's, the CUDA device's, else an H100."""
    if config.target is not None:
        return config.target
    if device.type == "cuda":
        return gpu_for_name(torch.cuda.get_device_name(device)) or "h100"
    return "h100"


def candidates(model: nn.Module) -> tuple[list[tuple[str, nn.Linear]], dict[str, str]]:
    """Every plain ``nn.Linear`` of ``model`` with its path, and for those that ``"all"`` and
    ``"auto"`` leave out, why (output head, tied to an embedding, own policy)."""
    linears = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
    ]
    tied = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and isinstance(m.weight, Tensor)
    }
    left_out: dict[str, str] = {}
    if linears:
        left_out[linears[-1][0]] = "output head (the model's last Linear): stays 16-bit"
    for name, m in linears:
        if id(m.weight) in tied:
            left_out[name] = "shares its weight with an embedding: stays 16-bit"
        elif POLICY_ATTR in m.__dict__:
            left_out[name] = f"has its own policy ({m.__dict__[POLICY_ATTR]}): runs as it says"
    return linears, left_out


def prepare(
    model: nn.Module, config: FP8Config, device: torch.device, source: str = "initialize"
) -> dict[str, FP8Layer]:
    """Judge every Linear of ``model`` under ``config`` and give the chosen (and the pending)
    ones an :class:`FP8Forward`. Returns ``{name: FP8Layer}``, also kept on the model."""
    unprepare(model)
    target = default_target(device, config)
    linears, left_out = candidates(model)
    layers: dict[str, FP8Layer] = {}
    selector = config.layers
    for name, m in linears:
        layer = FP8Layer(name, config, target, source)
        bad_shape = layer_shape_ok(m.in_features, m.out_features)
        own = POLICY_ATTR in m.__dict__ or "forward" in m.__dict__
        if own:  # whatever selects it: its policy (or its own forward wrapper) decides
            layer.choice = FP8Choice(
                name, False, left_out.get(name, "has its own forward wrapper: runs as it says")
            )
        elif isinstance(selector, FP8Plan):
            given = selector.get(name)
            layer.choice = (
                FP8Choice(name, False, "not in the plan given as layers=")
                if given is None
                else given
            )
            if layer.choice.fp8 and bad_shape:
                layer.choice = FP8Choice(name, False, bad_shape)
        elif callable(selector):
            if not selector(name, m):
                layer.choice = FP8Choice(name, False, "not selected by the layers= predicate")
            else:
                fp8 = bad_shape is None
                layer.choice = FP8Choice(name, fp8, bad_shape or "selected by layers=")
        elif name in left_out:
            layer.choice = FP8Choice(name, False, left_out[name])
        elif bad_shape is not None:
            layer.choice = FP8Choice(name, False, bad_shape)
        elif selector == "all":
            layer.choice = FP8Choice(name, True, "layers='all'")
        # "auto": pending until the first batch
        layers[name] = layer
        if layer.choice is None or layer.choice.fp8:
            m.__dict__[FP8_ATTR] = layer
            m.__dict__["forward"] = FP8Forward(m, layer)
    model.__dict__[REGISTRY_ATTR] = layers
    if not isinstance(selector, FP8Plan):  # a plan given as it is chose its layers knowingly
        verdict = _Verdict(layers, config)
        for layer in layers.values():
            layer.verdict = verdict
        verdict.check()
    return layers


class _Verdict:
    """Says once, when the last of a model's layers has decided, that ``fp8=`` chose none.

    ``"auto"`` decides at each layer's first batch, so before the first step the plan says
    "pending", and a model whose Linears are all too small (or all left out) would run no FP8
    without a word. The warning names the count, the reasons and how to force layers."""

    def __init__(self, layers: dict[str, FP8Layer], config: FP8Config) -> None:
        self.layers = layers
        self.config = config
        self.target = next((layer.target for layer in layers.values()), "the target GPU")
        self.said = False

    def check(self) -> None:
        layers = self.layers.values()
        if self.said or any(layer.choice is None for layer in layers):
            return
        self.said = True
        if any(layer.fp8 for layer in layers):
            return
        reasons = [f"{layer.name or '(the model)'}: {layer.choice.reason}" for layer in layers]
        shown = "; ".join(reasons[:3])
        if len(reasons) > 3:
            shown += f"; ... ({len(reasons) - 3} more in mixprec.fp8.fp8_plan(model))"
        why = f" ({shown})" if reasons else ": the model has no nn.Linear"
        warnings.warn(
            f"fp8= (recipe {self.config.recipe!r}, layers={_selector_name(self.config)}) chose "
            f"0 of {len(reasons)} Linears: every GEMM stays 16-bit{why}. To force FP8 on "
            "Linears whose in and out features are multiples of 16, use "
            "FP8Config(layers='all') or FP8Config(layers=lambda name, module: ...); 'auto' "
            f"judges the speed for {self.target} at the batch's tokens, so a larger batch may "
            "choose more.",
            MixprecPerformanceWarning,
            stacklevel=user_stacklevel(),
        )


def _selector_name(config: FP8Config) -> str:
    layers = config.layers
    return repr(layers) if isinstance(layers, str) else "a predicate"


def unprepare(model: nn.Module) -> None:
    """Remove every :class:`FP8Forward` that :func:`prepare` installed in ``model``."""
    for m in model.modules():
        if isinstance(m.__dict__.get("forward"), FP8Forward):
            del m.__dict__["forward"]
        m.__dict__.pop(FP8_ATTR, None)
    model.__dict__.pop(REGISTRY_ATTR, None)


def layers_of(model: nn.Module) -> dict[str, FP8Layer]:
    """``{name: FP8Layer}`` of a model prepared for FP8 (empty otherwise; not a copy)."""
    inner = getattr(model, "_orig_mod", model)  # a torch.compile'd model
    return inner.__dict__.get(REGISTRY_ATTR, _EMPTY)


_EMPTY: dict[str, FP8Layer] = {}


# -- mixprec.autocast(fp8=...) ---------------------------------------------------------------


class _Regions(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[FP8Config, Any]] = []


_regions = _Regions()
_region_roots: weakref.WeakKeyDictionary[nn.Module, FP8Config] = weakref.WeakKeyDictionary()


def _region_active() -> bool:
    return bool(_regions.stack)


def enter_region(config: FP8Config) -> None:
    """Open an FP8 region: the first module called in it is taken as the model, and its
    Linears are prepared (once per model and config) with ``source="region"``."""
    handle = None

    def first_module(module: nn.Module, args: Any) -> None:
        handle.remove()
        root = getattr(module, "_orig_mod", module)
        prepared = root.__dict__.get(REGISTRY_ATTR)
        if prepared and next(iter(prepared.values())).source == "initialize":
            return  # initialize(fp8=...) owns this model's layers
        if _region_roots.get(root) is not config or prepared is None:
            device = next((p.device for p in root.parameters()), torch.device("cpu"))
            check_device(device)
            prepare(root, config, device, source="region")
            _region_roots[root] = config

    handle = torch.nn.modules.module.register_module_forward_pre_hook(first_module)
    _regions.stack.append((config, handle))


def exit_region() -> None:
    _, handle = _regions.stack.pop()
    handle.remove()  # if no module ran in the region
