"""``mixprec.export``: write a mixed-precision model as ONNX or as a ``torch.export`` program.

Design (ONNX Runtime's and onnxconverter's "float16 conversion with a block list", driven by
mixprec's own cast table instead of a hand-kept list; ``docs/design.md``, "Inference and export"):

* **ONNX = an fp32 export, then a precision pass on the ONNX graph.** The model's fp32 twin
  (16-bit weights widen exactly) goes through ``torch.onnx.export(dynamo=True)`` (opset 20 by
  default: the first with ``Gelu``; ``LayerNormalization`` needs >= 17). :func:`mix_onnx` then
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

from mixprec.core.cast_table import FP32, LOWER, rule_for
from mixprec.inference.inputs import call_model
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

# ONNX op type -> the cast-table name whose rule it follows (the rule itself is read from the
# current table, so register_op / cast_rules changes apply to exports too).
_ONNX_OPS: dict[str, str] = {
    "MatMul": "matmul",
    "Gemm": "addmm",
    "Conv": "convolution",
    "ConvTranspose": "conv_transpose2d",
    "Einsum": "einsum",
    "Attention": "scaled_dot_product_attention",
    "Softmax": "softmax",
    "LogSoftmax": "log_softmax",
    "LayerNormalization": "layer_norm",
    "GroupNormalization": "group_norm",
    "RMSNormalization": "rms_norm",
    "LpNormalization": "normalize",
    "ReduceSum": "sum",
    "ReduceMean": "mean",
    "ReduceProd": "prod",
    "ReduceLogSumExp": "logsumexp",
    "ReduceL1": "norm",
    "ReduceL2": "norm",
    "ReduceSumSquare": "sum",
    "CumSum": "cumsum",
    "Exp": "exp",
    "Log": "log",
    "Pow": "pow",
    "Reciprocal": "reciprocal",
    "Softplus": "softplus",
    "Acos": "acos",
    "Asin": "asin",
    "Cosh": "cosh",
    "Sinh": "sinh",
    "Tan": "tan",
    "Add": "add",
    "Sub": "sub",
    "Mul": "mul",
    "Div": "div",
    "Max": "maximum",
    "Min": "minimum",
    "Where": "where",
    "Concat": "cat",
    "Equal": "eq",
    "Less": "lt",
    "LessOrEqual": "le",
    "Greater": "gt",
    "GreaterOrEqual": "ge",
    "ScatterND": "index_put",
}
# (op type, input index) whose float input has a fixed type, whatever the node computes in.
_FIXED_INPUTS = {
    ("Resize", 1),
    ("Resize", 2),
    ("DynamicQuantizeLinear", 0),
    ("DequantizeLinear", 1),
    ("QuantizeLinear", 0),
    ("QuantizeLinear", 1),
}
# op types whose float outputs do not follow their float inputs
_FIXED_OUTPUTS = {
    "Cast",
    "CastLike",
    "DequantizeLinear",
    "DynamicQuantizeLinear",
    "ConstantOfShape",
    "RandomNormal",
    "RandomUniform",
    "EyeLike",
    "Shape",
    "Size",
}


class ExportError(RuntimeError):
    """An export could not be produced, or does not run / match the PyTorch model."""


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


def onnx_rule(op_type: str) -> str | None:
    """The cast-table rule an ONNX op type follows (None: it runs in its input dtype)."""
    name = _ONNX_OPS.get(op_type)
    return None if name is None else rule_for(name)


def _onnx():
    try:
        import onnx
    except ImportError as e:
        raise ImportError(
            "ONNX export needs the onnx, onnxscript and onnxruntime packages: "
            "pip install onnx onnxscript onnxruntime"
        ) from e
    return onnx


def _elem(dtype: torch.dtype) -> int:
    onnx = _onnx()
    return {
        torch.float32: onnx.TensorProto.FLOAT,
        torch.float16: onnx.TensorProto.FLOAT16,
        torch.bfloat16: onnx.TensorProto.BFLOAT16,
    }[dtype]


def _np_dtype(elem: int) -> Any:
    import ml_dtypes
    import numpy as np

    onnx = _onnx()
    return {
        onnx.TensorProto.FLOAT: np.float32,
        onnx.TensorProto.FLOAT16: np.float16,
        onnx.TensorProto.BFLOAT16: ml_dtypes.bfloat16,
    }[elem]


def mix_onnx(model: Any, dtype: torch.dtype, compute: str = "16bit") -> Any:
    """Apply the cast table to an fp32 ONNX ``ModelProto`` (returns a new one).

    Args:
        model: a float32 ONNX model.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        compute: ``"16bit"`` (nodes compute in ``dtype``) or ``"fp32"`` (16-bit storage only).
    """
    onnx = _onnx()
    from onnx import helper, numpy_helper

    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"mix_onnx needs a 16-bit dtype, received {dtype}.")
    if compute not in ("16bit", "fp32"):
        raise ValueError(f"compute must be '16bit' or 'fp32', received {compute!r}.")
    F, low = onnx.TensorProto.FLOAT, _elem(dtype)
    model = onnx.shape_inference.infer_shapes(model)
    g = model.graph
    # float Constant nodes become initializers, so they are stored like weights
    inits = {i.name: i for i in g.initializer}
    nodes = []
    for n in g.node:
        value = next((a.t for a in n.attribute if a.name == "value"), None)
        if n.op_type == "Constant" and value is not None and value.data_type == F:
            t = onnx.TensorProto()
            t.CopyFrom(value)
            t.name = n.output[0]
            inits[t.name] = t
        else:
            nodes.append(n)
    types: dict[str, int] = {}
    for v in (*g.input, *g.value_info, *g.output):
        types[v.name] = v.type.tensor_type.elem_type
    for name, t in inits.items():
        types[name] = t.data_type
    float_inits = {k for k, t in inits.items() if t.data_type == F}
    for n in nodes:
        if any(a.type == onnx.AttributeProto.GRAPH for a in n.attribute) and compute == "16bit":
            raise ExportError(
                f"The ONNX graph has control flow ({n.op_type} node {n.name!r}); "
                "the precision pass does not enter subgraphs. Use "
                "compute='fp32' (16-bit storage only) or format='torch'."
            )

    cur = {v.name: v.type.tensor_type.elem_type for v in g.input}
    requests: dict[str, set[int]] = {k: set() for k in float_inits}
    new_nodes: list[Any] = []
    casts: dict[tuple[str, int], str] = {}
    uses: list[tuple[Any, int, str, int]] = []  # (node, input index, initializer, dtype)

    def cast(value: str, to: int) -> str:
        key = (value, to)
        if key not in casts:
            out = f"{value}__to_{'fp32' if to == F else 'low'}"
            new_nodes.append(
                helper.make_node("Cast", [value], [out], to=to, name=f"mixprec_cast_{len(casts)}")
            )
            casts[key] = out
        return casts[key]

    for n in nodes:
        ins = list(n.input)
        floats = [
            i
            for i, x in enumerate(ins)
            if x and (types.get(x) == F) and (n.op_type, i) not in _FIXED_INPUTS
        ]
        dyn = [i for i in floats if ins[i] not in float_inits]
        rule = onnx_rule(n.op_type)
        target: int | None
        if n.op_type in _FIXED_OUTPUTS:
            target = None
            if (
                n.op_type == "Cast"
                and ins[0] in inits
                and inits[ins[0]].data_type != F
                and compute == "16bit"
            ):
                for a in n.attribute:  # dequantizing an int8 weight: straight to 16-bit
                    if a.name == "to" and a.i == F:
                        a.i = low
        elif rule == LOWER:
            target = low
        elif rule == FP32:
            target = F
        elif dyn:
            found = {cur.get(ins[i], F) for i in dyn}
            target = found.pop() if len(found) == 1 else F
        else:
            target = low if floats else None
        for i in floats:
            x = ins[i]
            if x in float_inits:
                want = target if target is not None else F
                requests[x].add(want)
                uses.append((n, i, x, want))
            elif target is not None and cur.get(x, F) != target and compute == "16bit":
                n.input[i] = cast(x, target)
        for o in n.output:
            if n.op_type == "Cast":
                cur[o] = next(a.i for a in n.attribute if a.name == "to")
            elif types.get(o) == F and target is not None:
                cur[o] = target
            else:
                cur[o] = types.get(o, 0)
        new_nodes.append(n)

    if compute == "fp32":  # storage only: keep the fp32 graph, narrow the initializers
        return _storage_only(model, nodes, inits, requests, low)

    new_inits = [t for k, t in inits.items() if k not in float_inits]
    renamed: dict[tuple[str, int], str] = {}
    for name in float_inits:
        wanted = requests[name] or {F}
        for k, want in enumerate(sorted(wanted)):
            new_name = name if k == 0 else f"{name}__{'fp32' if want == F else 'low'}"
            arr = numpy_helper.to_array(inits[name])
            new_inits.append(numpy_helper.from_array(_narrow(arr, want), new_name))
            renamed[(name, want)] = new_name
    for n, i, name, want in uses:
        n.input[i] = renamed[(name, want)]
    outputs = {o.name for o in g.output}
    tail = []
    for o in g.output:
        if o.type.tensor_type.elem_type == F and cur.get(o.name, F) != F:
            inner = o.name + "__low"
            for n in new_nodes:
                n.output[:] = [inner if x == o.name else x for x in n.output]
                n.input[:] = [inner if x == o.name else x for x in n.input]
            tail.append(
                helper.make_node(
                    "Cast", [inner], [o.name], to=F, name=f"mixprec_cast_out_{len(tail)}"
                )
            )
    del outputs
    return _replace_graph(model, new_nodes + tail, new_inits)


def _storage_only(
    model: Any, nodes: list[Any], inits: dict[str, Any], requests: dict[str, set[int]], low: int
) -> Any:
    onnx = _onnx()
    from onnx import helper, numpy_helper

    head, new_inits = [], []
    for name, t in inits.items():
        if requests.get(name) == {low}:
            arr = _narrow(numpy_helper.to_array(t), low)
            new_inits.append(numpy_helper.from_array(arr, name + "__low"))
            head.append(
                helper.make_node(
                    "Cast",
                    [name + "__low"],
                    [name],
                    to=onnx.TensorProto.FLOAT,
                    name=f"mixprec_widen_{name}",
                )
            )
        else:
            new_inits.append(t)
    return _replace_graph(model, head + nodes, new_inits)


def _replace_graph(model: Any, nodes: list[Any], inits: list[Any]) -> Any:
    """Give ``model``'s graph these nodes and initializers; re-infer (strictly) its shapes."""
    g = model.graph
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(inits)
    del g.value_info[:]
    return _onnx().shape_inference.infer_shapes(model, strict_mode=True)


def _narrow(arr: Any, elem: int) -> Any:
    """``arr`` in ONNX type ``elem``; finite values are clipped to its range (fp16 max 65504), so
    fp32 "minus infinity" masks (``finfo(float32).min``) stay finite, as in torch."""
    import numpy as np

    target = _np_dtype(elem)
    if target is np.float32:
        return arr.astype(np.float32)
    big = float(torch.finfo(torch.float16 if target is np.float16 else torch.bfloat16).max)
    finite = np.isfinite(arr)
    return np.where(finite, np.clip(arr, -big, big), arr).astype(target)


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
    import warnings

    if opset < 17:
        raise ValueError(f"opset {opset} is too old: LayerNormalization needs opset >= 17.")
    notes: list[str] = []
    low = dtype in (torch.float16, torch.bfloat16)
    if compute == "16bit" and low and check and not ort_can_run(dtype, providers[0]):
        # fail before the (slow) export: the file could be written but not checked here
        raise ExportError(
            f"ONNX Runtime's {providers[0]} has no {dtype} MatMul kernel, so a "
            f"compute='16bit' {dtype} graph cannot run or be checked with it. "
            + _HINT.get(dtype, "")
            + " Or pass check=False to write the file "
            "for another runtime without running it."
        )
    if compute == "auto":
        compute = "16bit" if low and ort_can_run(dtype, providers[0]) else "fp32"
        if low and compute == "fp32":
            notes.append(
                f"{providers[0]} has no {dtype} MatMul kernel: weights stored in "
                f"{dtype}, computed in float32 (compute='fp32')."
            )
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
    proto = program.model_proto
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
        try:
            sess = ort_session(path, providers)
        except Exception as e:
            raise ExportError(
                f"ONNX Runtime ({providers[0]}) cannot load the {dtype} model "
                f"(compute={compute!r}): {str(e).splitlines()[0]}. " + _HINT.get(dtype, "")
            ) from e
        feeds = _feeds(sess, args, kwargs)
        try:
            got = [
                torch.from_numpy(o.astype("float32") if o.dtype.kind == "f" else o)
                for o in sess.run(None, feeds)
            ]
        except Exception as e:
            raise ExportError(
                f"ONNX Runtime ({providers[0]}) cannot run the {dtype} model "
                f"(compute={compute!r}): {str(e).splitlines()[0]}. " + _HINT.get(dtype, "")
            ) from e
        result.max_abs_error, result.cosine = _compare(got, reference, "The ONNX model")
        _check_cosine(result, min_cosine)
    return result


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
