"""int8 mixing: selected Linear/Conv weights stored as int8 in a 16-bit/fp32 inference model.

Design (the seed's note that inference chips mix int8 and int16 within one model; the same
"measure, then keep what is accurate" rule the training side uses for its dtypes):

* **Two int8 modes.** ``"dynamic"`` swaps ``nn.Linear`` for PyTorch's own dynamically quantized
  Linear (``torch.ao.quantization.quantize_dynamic``: int8 weights, activations quantized per
  call, int8 GEMM on x86/ARM CPUs). It is fast on CPU but eager-only: ``torch.export`` and the
  ONNX exporter cannot trace its packed weights. ``"weight_only"`` stores an int8 weight with a
  float32 per-output-channel scale (:class:`Int8WeightOnly`) and dequantizes to the compute
  dtype in ``forward``; it runs on any device and exports (ONNX: int8 initializer + Cast + Mul).
* **Accuracy-driven choice** (``modules="auto"``): each candidate is quantized alone and its
  error against the fp32 reference output measured on the example batch; candidates are then
  added from least to most sensitive while the error of the whole model stays within
  ``tolerance`` (default: 1 - cosine similarity <= 1e-3). A numerics tuner shared with training
  (``mixprec.numerics.tune``) was not available when this was written; this greedy pass is the
  tuner here.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec._core.engine import set_policy
from mixprec.inference.inputs import call_model

__all__ = ["INT8_MODES", "Int8WeightOnly", "cosine_error", "int8_candidates", "quantize_int8"]

INT8_MODES = ("dynamic", "weight_only")
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


class Int8WeightOnly(nn.Module):
    """A Linear or Conv whose weight is int8 (symmetric, per output channel) plus fp32 scales.

    ``forward`` dequantizes the weight to the input's dtype and runs the original op, so the
    matmul/conv itself runs in the 16-bit compute dtype (or fp32), as the cast table says.
    """

    def __init__(self, module: nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d):
        super().__init__()
        w = module.weight.detach().float()
        scale = w.abs().flatten(1).amax(1).clamp(min=1e-12) / 127.0
        shape = (-1,) + (1,) * (w.dim() - 1)
        self.register_buffer(
            "weight_int8", torch.round(w / scale.view(shape)).clamp(-127, 127).to(torch.int8)
        )
        self.register_buffer("weight_scale", scale.view(shape))
        bias = module.bias
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )
        self.kind = "linear" if isinstance(module, nn.Linear) else f"conv{w.dim() - 2}d"
        self.conv_args: dict[str, Any] = (
            {}
            if self.kind == "linear"
            else dict(
                stride=module.stride,
                padding=module.padding,
                dilation=module.dilation,
                groups=module.groups,
            )
        )
        if self.kind != "linear" and module.padding_mode != "zeros":
            raise ValueError(
                f"Int8WeightOnly supports zero padding only, received "
                f"padding_mode={module.padding_mode!r}."
            )

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype if x.is_floating_point() else torch.float32
        w = self.weight_int8.to(dtype) * self.weight_scale.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        if self.kind == "linear":
            return F.linear(x, w, bias)
        return getattr(F, self.kind)(x, w, bias, **self.conv_args)

    def extra_repr(self) -> str:
        return f"{self.kind}, weight {tuple(self.weight_int8.shape)} int8 per-channel"


def int8_candidates(model: nn.Module, mode: str = "weight_only") -> list[str]:
    """Names of the modules :func:`quantize_int8` can store as int8 in ``mode``."""
    kinds = (nn.Linear,) if mode == "dynamic" else (nn.Linear, *_CONVS)
    return [n for n, m in model.named_modules() if type(m) in kinds and n]


def cosine_error(output: Any, reference: Any) -> float:
    """1 - cosine similarity of the flattened floating outputs (0 means identical direction)."""
    out, ref = _flat(output), _flat(reference)
    return float(1.0 - F.cosine_similarity(out, ref, dim=0))


def _flat(obj: Any) -> Tensor:
    if isinstance(obj, Tensor):
        return obj.detach().double().flatten()
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        parts = [_flat(o) for o in obj if isinstance(o, (Tensor, list, tuple, dict))]
        return torch.cat([p for p in parts if p.numel()]) if parts else torch.zeros(0)
    if hasattr(obj, "to_tuple"):  # Hugging Face ModelOutput
        return _flat(obj.to_tuple())
    raise TypeError(f"Cannot compare outputs of type {type(obj).__name__}.")


def _quantized(module: nn.Module, mode: str) -> nn.Module:
    if mode == "weight_only":
        return Int8WeightOnly(module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notice (torchao migration)
        holder = nn.Sequential(copy.deepcopy(module).float())
        q = torch.ao.quantization.quantize_dynamic(holder, {nn.Linear}, dtype=torch.qint8)
    return q[0]


def _set(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, module)
    return old


def _mark_fp32(module: nn.Module) -> None:
    set_policy(module, "float32")  # torch.ao's int8 kernels take and return float32


def _run(model: nn.Module, inputs: Any) -> Any:
    with torch.no_grad():
        return call_model(model, inputs)


def quantize_int8(
    model: nn.Module,
    modules: str | Iterable[str] = "auto",
    *,
    mode: str = "weight_only",
    example_inputs: Any = None,
    reference: Any = None,
    tolerance: float = 1e-3,
    metric: Callable[[Any, Any], float] | None = None,
) -> tuple[nn.Module, list[str]]:
    """Store the chosen Linear/Conv modules of ``model`` as int8 (in place).

    Args:
        model: usually a :func:`mixprec.for_inference` model.
        modules: ``"auto"`` or an explicit list of module names.
        mode: ``"weight_only"`` or ``"dynamic"`` (see the module docstring).
        example_inputs: the batch for ``"auto"``.
        reference: the fp32 model's output on ``example_inputs`` (``"auto"``); defaults to the
            output of ``model`` itself before quantization.
        tolerance: the largest ``metric`` allowed for the whole model (``"auto"``).
        metric: ``f(output, reference) -> error``; default :func:`cosine_error`.

    Returns:
        ``(model, chosen module names)``.
    """
    if mode not in INT8_MODES:
        raise ValueError(f"int8 mode must be one of {INT8_MODES}, received {mode!r}.")
    candidates = int8_candidates(model, mode)
    if modules == "auto":
        if example_inputs is None:
            raise ValueError("modules='auto' needs example_inputs to measure accuracy.")
        metric = metric or cosine_error
        if reference is None:
            reference = _run(model, example_inputs)
        base = metric(_run(model, example_inputs), reference)
        cost: dict[str, float] = {}
        for name in candidates:  # one at a time: the sensitivity of each module
            old = _set(model, name, q := _quantized(model.get_submodule(name), mode))
            if mode == "dynamic":
                _mark_fp32(q)
            cost[name] = metric(_run(model, example_inputs), reference) - base
            _set(model, name, old)
        chosen: list[str] = []
        for name in sorted(candidates, key=lambda n: cost[n]):
            if cost[name] + base > tolerance:
                break
            old = _set(model, name, q := _quantized(model.get_submodule(name), mode))
            if mode == "dynamic":
                _mark_fp32(q)
            if metric(_run(model, example_inputs), reference) > tolerance:
                _set(model, name, old)  # over budget together with the others: keep 16-bit
            else:
                chosen.append(name)
        return model, sorted(chosen, key=candidates.index)
    if isinstance(modules, str):
        raise TypeError(f"modules must be 'auto' or a list of module names, received {modules!r}.")
    chosen = list(modules)
    bad = [n for n in chosen if n not in candidates]
    if bad:
        kinds = "nn.Linear" if mode == "dynamic" else "nn.Linear/Conv1-3d"
        more = "..." if len(candidates) > 8 else ""
        raise ValueError(
            f"Cannot store {bad} as int8 in mode {mode!r}: only {kinds} modules "
            f"can be; candidates are {candidates[:8]}{more}."
        )
    for name in chosen:
        q = _quantized(model.get_submodule(name), mode)
        _set(model, name, q)
        if mode == "dynamic":
            _mark_fp32(q)
    return model, chosen
