"""``mixprec.inference.export``: write a mixed-precision model as ONNX or as a ``torch.export``
program.

Design (ONNX Runtime's and onnxconverter's "float16 conversion with a block list", driven by
mixprec's own cast table instead of a hand-kept list; ``docs/design.md``, "Inference and export"):

* **ONNX = an fp32 export, then a precision pass on the ONNX graph.** The model's fp32 twin
  (16-bit weights widen exactly) goes through ``torch.onnx.export(dynamo=True)`` (opset 20 by
  default: the first with ``Gelu``; ``LayerNormalization`` needs >= 17). :func:`mix_onnx`
  (:mod:`mixprec.inference.onnx_pass`, a module of its own: it only rewrites the graph) then
  gives every node a dtype from the cast table -- ``MatMul``/``Gemm``/``Conv`` are ``"lower"``,
  ``Softmax``/``LayerNormalization``/``Reduce*``/``Exp``/``Pow`` are ``"fp32"``, binary ops
  promote, anything else runs in its input dtype -- stores each float initializer in the dtype of
  its consumers, and inserts a ``Cast`` only where a value crosses a rule boundary. Graph inputs
  and outputs keep their fp32 type (the policy's float32 outputs). Exporting the engine-hooked
  16-bit model directly would bake torch.autocast's implicit casts and the exporter's own
  constant folding into the graph; the pass keeps the graph's dtypes an explicit function of the
  table, which the tests check weight by weight.
* **Two ONNX compute modes.** ``"16bit"``: nodes compute in the 16-bit dtype. ``"fp32"``:
  16-bit *storage* only -- initializers stored 16-bit, each followed by a ``Cast`` to float32,
  every node in fp32 (half the file, fp32 speed: ONNX Runtime folds the casts at load).
  ONNX Runtime's CPU provider has no bfloat16 kernels at all (not even ``MatMul``); its float16
  kernels exist (ops without one get fp32 casts inserted by ORT). So ``compute="auto"`` picks
  ``"16bit"`` where ORT's CPU provider can run the dtype and ``"fp32"`` otherwise (bf16 here),
  probing once with a one-node model. GPU providers (CUDA, TensorRT) run bf16/fp16 graphs: ask
  for ``compute="16bit"`` and ``providers=[...]``.
* **torch format = ``torch.export`` of the :func:`mixprec.for_inference` model itself**, engine
  hooks and all: the program stores the 16-bit weights and records the engine's casts.
* Every export is checked by default: the file is loaded back (ONNX Runtime / ``torch.export
  .load``), run on the example inputs and compared with the PyTorch model.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.inference.inputs import call_model
from mixprec.inference.onnx_pass import ExportError, _elem, _np_dtype, _onnx, mix_onnx, onnx_rule
from mixprec.inference.prepare import for_inference, inference_info, to_fp32_twin

__all__ = [
    "ExportError",
    "ExportResult",
    "export",
    "mix_onnx",
    "onnx_rule",
    "ort_can_run",
    "ort_session",
]

FORMATS = ("onnx", "torch")
COMPUTE = ("auto", "16bit", "fp32")
DEFAULT_OPSET = 20


@dataclass
class ExportResult:
    """What :func:`export` wrote.

    Attributes:
        path: the file.
        format: ``"onnx"`` or ``"torch"``.
        dtype: the model's 16-bit (or fp32) compute dtype.
        compute: ONNX compute mode actually used (``"16bit"``/``"fp32"``), or ``"torch"``.
        weight_dtypes: ``{initializer or state-dict name: dtype name}`` in the written file.
        casts: number of ``Cast`` nodes in the ONNX graph (None for torch).
        max_abs_error: max |file output - PyTorch output| on the example inputs (if checked).
        cosine: cosine similarity of the same two outputs (if checked).
        notes: fallbacks taken, in words.
    """

    path: str
    format: str
    dtype: torch.dtype
    compute: str
    weight_dtypes: dict[str, str] = field(default_factory=dict)
    casts: int | None = None
    max_abs_error: float | None = None
    cosine: float | None = None
    notes: list[str] = field(default_factory=list)


@functools.cache
def ort_can_run(dtype: torch.dtype, provider: str = "CPUExecutionProvider") -> bool:
    """Whether ONNX Runtime's ``provider`` has a ``MatMul`` kernel for ``dtype`` (probed once)."""
    onnx = _onnx()
    import numpy as np
    from onnx import helper

    elem = _elem(dtype)
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    graph = helper.make_graph(
        [node],
        "probe",
        [helper.make_tensor_value_info(n, elem, [2, 2]) for n in "ab"],
        [helper.make_tensor_value_info("y", elem, [2, 2])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", DEFAULT_OPSET)])
    proto.ir_version = min(proto.ir_version, 10)
    del onnx
    try:
        sess = ort_session(proto.SerializeToString(), [provider])
        x = np.ones((2, 2), dtype=_np_dtype(elem))
        sess.run(None, {"a": x, "b": x})
        return True
    except Exception:  # noqa: BLE001 - ORT raises its own types (NOT_IMPLEMENTED, ...)
        return False


def ort_session(
    model: Any,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    threads: int | None = None,
    spin: bool = True,
) -> Any:
    """An ONNX Runtime session for a path, bytes or ``ModelProto``.

    ``spin=False`` stops ORT's worker threads from busy-waiting after each run, which would
    otherwise take the CPU from whatever runs next (PyTorch, in an interleaved benchmark).
    """
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise ImportError("Running ONNX models needs onnxruntime: pip install onnxruntime") from e
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    return ort.InferenceSession(model, opts, providers=list(providers))


def _as_args(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    return (example_inputs,), {}


def _flat_outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    return [t for o in out for t in _flat_outputs(o)] if isinstance(out, (list, tuple)) else []


def _compare(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> tuple[float, float]:
    if len(got) != len(want):
        raise ExportError(f"{what} returned {len(got)} outputs, the PyTorch model {len(want)}.")
    g = torch.cat([t.detach().double().flatten() for t in got])
    w = torch.cat([t.detach().double().flatten() for t in want])
    if g.shape != w.shape:
        raise ExportError(f"{what} output shape {tuple(g.shape)} != PyTorch {tuple(w.shape)}.")
    if not torch.isfinite(g).all() and torch.isfinite(w).all():
        raise ExportError(f"{what} produced inf/NaN where the PyTorch model is finite.")
    cos = float(torch.nn.functional.cosine_similarity(g, w, dim=0)) if g.numel() else 1.0
    return float((g - w).abs().max()) if g.numel() else 0.0, cos


def export(
    model: nn.Module,
    example_inputs: Any,
    path: str | os.PathLike,
    format: str = "onnx",
    *,
    policy: Any = None,
    compute: str = "auto",
    opset: int = DEFAULT_OPSET,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    check: bool = True,
    min_cosine: float = 0.99,
) -> ExportResult:
    """Write ``model`` as a mixed-precision ONNX file or ``torch.export`` program.

    Args:
        model: a :func:`mixprec.for_inference` model; any other module is first converted with
            ``for_inference(model, policy, example_inputs)``.
        example_inputs: a tensor, a tuple of positional inputs or a dict of keyword inputs.
        path: the file to write (``.onnx`` / ``.pt2`` by convention).
        format: ``"onnx"`` or ``"torch"``.
        policy: the policy for a model that is not yet an inference model.
        compute: ONNX only: ``"16bit"``, ``"fp32"`` (16-bit storage, fp32 compute) or ``"auto"``
            (``"16bit"`` if ``providers[0]`` runs the dtype, else ``"fp32"``).
        opset: ONNX opset (>= 17 for ``LayerNormalization``; default 20).
        providers: ONNX Runtime providers for the check (and for ``"auto"``).
        check: load the file back, run it and compare with the PyTorch model.
        min_cosine: the check fails below this cosine similarity to the PyTorch output.

    Raises:
        ExportError: the exporter cannot handle an op, the runtime cannot run the file, or
            the file's outputs do not match the PyTorch model.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, received {format!r}.")
    if compute not in COMPUTE:
        raise ValueError(f"compute must be one of {COMPUTE}, received {compute!r}.")
    if not isinstance(model, nn.Module):
        raise TypeError(f"export expects an nn.Module, received {type(model).__name__}.")
    info = inference_info(model)
    if info is None:
        model = for_inference(model, policy, example_inputs)
        info = inference_info(model)
    dtype = info.dtype
    args, kwargs = _as_args(example_inputs)
    if "dynamic" in info.int8.values():
        raise ExportError(
            f"Modules {sorted(k for k, v in info.int8.items() if v == 'dynamic')} "
            "use torch.ao dynamic int8 (packed weights), which torch.export and "
            "the ONNX exporter cannot trace. Build the model with "
            "int8='weight_only' to export int8 weights."
        )
    with torch.no_grad():
        reference = _flat_outputs(call_model(model, example_inputs))
    path = os.fspath(path)
    if format == "torch":
        return _export_torch(model, args, kwargs, path, dtype, reference, check, min_cosine)
    return _export_onnx(
        model,
        args,
        kwargs,
        path,
        dtype,
        compute,
        opset,
        list(providers),
        reference,
        check,
        min_cosine,
    )


def _export_torch(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    path: str,
    dtype: torch.dtype,
    reference: list[torch.Tensor],
    check: bool,
    min_cosine: float,
) -> ExportResult:
    try:
        program = torch.export.export(model, args, kwargs)
    except Exception as e:
        raise ExportError(
            f"torch.export could not trace {type(model).__name__}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    torch.export.save(program, path)
    result = ExportResult(
        path,
        "torch",
        dtype,
        "torch",
        {
            k: str(v.dtype).replace("torch.", "")
            for k, v in program.state_dict.items()
            if isinstance(v, torch.Tensor)
        },
    )
    if check:
        loaded = torch.export.load(path).module()
        with torch.no_grad():
            got = _flat_outputs(loaded(*args, **kwargs))
        result.max_abs_error, result.cosine = _compare(got, reference, "The torch.export program")
        _check_cosine(result, min_cosine)
    return result


def _check_cosine(result: ExportResult, min_cosine: float) -> None:
    if result.cosine is not None and result.cosine < min_cosine:
        raise ExportError(
            f"The exported {result.format} model's outputs differ from the PyTorch "
            f"model's: cosine similarity {result.cosine:.5f} < {min_cosine} (max "
            f"abs error {result.max_abs_error:.3g})."
        )


def _export_onnx(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    path: str,
    dtype: torch.dtype,
    compute: str,
    opset: int,
    providers: list[str],
    reference: list[torch.Tensor],
    check: bool,
    min_cosine: float,
) -> ExportResult:
    onnx = _onnx()
    if opset < 17:
        raise ValueError(f"opset {opset} is too old: LayerNormalization needs opset >= 17.")
    low = dtype in (torch.float16, torch.bfloat16)
    compute, notes = _onnx_compute(dtype, compute, providers[0], check)
    proto = _torch_onnx_export(model, args, kwargs, opset)
    if low:
        proto = mix_onnx(proto, dtype, compute)
    onnx.checker.check_model(proto)
    onnx.save(proto, path)
    weights = {
        t.name: onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name
        if t.data_type != onnx.TensorProto.BFLOAT16
        else "bfloat16"
        for t in proto.graph.initializer
    }
    result = ExportResult(
        path,
        "onnx",
        dtype,
        compute if low else "fp32",
        weights,
        sum(n.op_type == "Cast" for n in proto.graph.node),
        notes=notes,
    )
    if check:
        got = _run_onnx(path, providers, dtype, compute, args, kwargs)
        result.max_abs_error, result.cosine = _compare(got, reference, "The ONNX model")
        _check_cosine(result, min_cosine)
    return result


def _onnx_compute(
    dtype: torch.dtype, compute: str, provider: str, check: bool
) -> tuple[str, list[str]]:
    """The compute mode to export (``"auto"`` resolved against ``provider``) and the note on
    the fallback taken; raises before the slow export when a 16-bit graph could not be checked."""
    notes: list[str] = []
    low = dtype in (torch.float16, torch.bfloat16)
    if compute == "16bit" and low and check and not ort_can_run(dtype, provider):
        # fail before the (slow) export: the file could be written but not checked here
        raise ExportError(
            f"ONNX Runtime's {provider} has no {dtype} MatMul kernel, so a "
            f"compute='16bit' {dtype} graph cannot run or be checked with it. "
            + _HINT.get(dtype, "")
            + " Or pass check=False to write the file "
            "for another runtime without running it."
        )
    if compute == "auto":
        compute = "16bit" if low and ort_can_run(dtype, provider) else "fp32"
        if low and compute == "fp32":
            notes.append(
                f"{provider} has no {dtype} MatMul kernel: weights stored in "
                f"{dtype}, computed in float32 (compute='fp32')."
            )
    return compute, notes


def _torch_onnx_export(model: nn.Module, args: tuple, kwargs: dict, opset: int) -> Any:
    """The fp32 twin of ``model`` through ``torch.onnx.export(dynamo=True)``, the first dim of
    every input dynamic; the ONNX ``ModelProto``."""
    import warnings

    twin = to_fp32_twin(model).eval()
    quiet = logging.getLogger("onnxscript.optimizer._constant_folding")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "Evaluation failed" notes of the exporter's folding pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            batch = torch.export.Dim.AUTO  # the batch (first) dim of every input is dynamic
            shapes = (
                {
                    k: {0: batch} if isinstance(v, torch.Tensor) and v.dim() else None
                    for k, v in kwargs.items()
                }
                if kwargs
                else tuple(
                    {0: batch} if isinstance(a, torch.Tensor) and a.dim() else None for a in args
                )
            )
            program = torch.onnx.export(
                twin,
                args,
                kwargs=kwargs or None,
                dynamo=True,
                opset_version=opset,
                optimize=True,
                verbose=False,
                dynamic_shapes=shapes,
            )
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ExportError(
            f"torch.onnx.export (opset {opset}) cannot export "
            f"{type(model).__name__}: {type(e).__name__}: {first}. An op without "
            "an ONNX translation needs a custom_translation_table entry; "
            "format='torch' exports any op torch.export can trace."
        ) from e
    finally:
        quiet.setLevel(level)
    return program.model_proto


def _run_onnx(
    path: str,
    providers: list[str],
    dtype: torch.dtype,
    compute: str,
    args: tuple,
    kwargs: dict,
) -> list[torch.Tensor]:
    """The written file's outputs on the example inputs, through ONNX Runtime."""
    try:
        sess = ort_session(path, providers)
    except Exception as e:
        raise ExportError(
            f"ONNX Runtime ({providers[0]}) cannot load the {dtype} model "
            f"(compute={compute!r}): {str(e).splitlines()[0]}. " + _HINT.get(dtype, "")
        ) from e
    feeds = _feeds(sess, args, kwargs)
    try:
        return [
            torch.from_numpy(o.astype("float32") if o.dtype.kind == "f" else o)
            for o in sess.run(None, feeds)
        ]
    except Exception as e:
        raise ExportError(
            f"ONNX Runtime ({providers[0]}) cannot run the {dtype} model "
            f"(compute={compute!r}): {str(e).splitlines()[0]}. " + _HINT.get(dtype, "")
        ) from e


_HINT = {
    torch.bfloat16: "Use compute='fp32' (bf16 storage, fp32 compute), dtype float16, or a "
    "provider with bf16 kernels (CUDA/TensorRT).",
    torch.float16: "Use compute='fp32' (fp16 storage, fp32 compute).",
}


def _feeds(sess: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    flat = [*args, *kwargs.values()]
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    names = [i.name for i in sess.get_inputs()]
    if len(names) != len(tensors):
        raise ExportError(
            f"The ONNX model takes inputs {names}, but {len(tensors)} example tensors were given."
        )
    return {n: t.detach().cpu().numpy() for n, t in zip(names, tensors)}
