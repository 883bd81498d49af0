"""The precision pass on an fp32 ONNX graph: :func:`mix_onnx` gives every node a dtype from
mixprec's cast table.

Design (ONNX Runtime's and onnxconverter's "float16 conversion with a block list", driven by
the cast table instead of a hand-kept list): each ONNX op type maps to the cast-table op whose
rule it follows (:func:`onnx_rule`, read from the current table, so ``register_op`` changes
apply to exports too). One walk in graph order gives each node its dtype -- ``"lower"`` ops
compute in 16 bits, ``"fp32"`` ops in float32, the rest promote or follow their inputs -- and
inserts a ``Cast`` only where a value crosses a rule boundary. Initializers are then stored in
the dtype of their consumers (twice when consumers disagree) and graph outputs keep their fp32
type. The pass only reads and rewrites the ``ModelProto``; exporting and checking live in
:mod:`mixprec.inference.export`.

Its public names are listed (``__all__``) and imported from :mod:`mixprec.inference.export`.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._core.cast_table import FP32, LOWER, rule_for

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
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"mix_onnx needs a 16-bit dtype, received {dtype}.")
    if compute not in ("16bit", "fp32"):
        raise ValueError(f"compute must be '16bit' or 'fp32', received {compute!r}.")
    low = _elem(dtype)
    model = onnx.shape_inference.infer_shapes(model)
    g = model.graph
    inits, nodes = _constants_as_initializers(g)
    types: dict[str, int] = {}
    for v in (*g.input, *g.value_info, *g.output):
        types[v.name] = v.type.tensor_type.elem_type
    for name, t in inits.items():
        types[name] = t.data_type
    if compute == "16bit":
        _refuse_control_flow(nodes)
    walk = _DtypeWalk(types, inits, compute, low)
    walk.cur.update({v.name: v.type.tensor_type.elem_type for v in g.input})
    for n in nodes:
        walk.visit(n)
    if compute == "fp32":  # storage only: keep the fp32 graph, narrow the initializers
        return _storage_only(model, nodes, inits, walk.requests, low)
    new_inits = walk.stored_initializers()
    tail = _cast_outputs_back(g, walk.new_nodes, walk.cur)
    return _replace_graph(model, walk.new_nodes + tail, new_inits)


def _constants_as_initializers(g: Any) -> tuple[dict[str, Any], list[Any]]:
    """The graph's initializers with its float ``Constant`` nodes added (so they are stored
    like weights), and the other nodes."""
    onnx = _onnx()
    F = onnx.TensorProto.FLOAT
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
    return inits, nodes


def _refuse_control_flow(nodes: list[Any]) -> None:
    onnx = _onnx()
    for n in nodes:
        if any(a.type == onnx.AttributeProto.GRAPH for a in n.attribute):
            raise ExportError(
                f"The ONNX graph has control flow ({n.op_type} node {n.name!r}); "
                "the precision pass does not enter subgraphs. Use "
                "compute='fp32' (16-bit storage only) or format='torch'."
            )


class _DtypeWalk:
    """One walk over the nodes in graph order: each node's compute dtype, the ``Cast`` nodes
    it needs, and the dtype each float initializer is wanted in by each consumer."""

    def __init__(self, types: dict[str, int], inits: dict[str, Any], compute: str, low: int):
        self.F = _onnx().TensorProto.FLOAT
        self.types, self.inits, self.compute, self.low = types, inits, compute, low
        self.float_inits = {k for k, t in inits.items() if t.data_type == self.F}
        self.cur: dict[str, int] = {}  # value name -> its dtype in the mixed graph
        self.requests: dict[str, set[int]] = {k: set() for k in self.float_inits}
        self.new_nodes: list[Any] = []
        self.casts: dict[tuple[str, int], str] = {}
        self.uses: list[tuple[Any, int, str, int]] = []  # (node, input index, initializer, dtype)

    def cast(self, value: str, to: int) -> str:
        from onnx import helper

        key = (value, to)
        if key not in self.casts:
            out = f"{value}__to_{'fp32' if to == self.F else 'low'}"
            self.new_nodes.append(
                helper.make_node(
                    "Cast", [value], [out], to=to, name=f"mixprec_cast_{len(self.casts)}"
                )
            )
            self.casts[key] = out
        return self.casts[key]

    def visit(self, n: Any) -> None:
        F, cur = self.F, self.cur
        ins = list(n.input)
        floats = [
            i
            for i, x in enumerate(ins)
            if x and (self.types.get(x) == F) and (n.op_type, i) not in _FIXED_INPUTS
        ]
        target = self._target(n, ins, floats)
        for i in floats:
            x = ins[i]
            if x in self.float_inits:
                want = target if target is not None else F
                self.requests[x].add(want)
                self.uses.append((n, i, x, want))
            elif target is not None and cur.get(x, F) != target and self.compute == "16bit":
                n.input[i] = self.cast(x, target)
        for o in n.output:
            if n.op_type == "Cast":
                cur[o] = next(a.i for a in n.attribute if a.name == "to")
            elif self.types.get(o) == F and target is not None:
                cur[o] = target
            else:
                cur[o] = self.types.get(o, 0)
        self.new_nodes.append(n)

    def _target(self, n: Any, ins: list[str], floats: list[int]) -> int | None:
        """The dtype node ``n`` computes in (None: it does not follow its float inputs)."""
        F, low = self.F, self.low
        rule = onnx_rule(n.op_type)
        if n.op_type in _FIXED_OUTPUTS:
            if (
                n.op_type == "Cast"
                and ins[0] in self.inits
                and self.inits[ins[0]].data_type != F
                and self.compute == "16bit"
            ):
                for a in n.attribute:  # dequantizing an int8 weight: straight to 16-bit
                    if a.name == "to" and a.i == F:
                        a.i = low
            return None
        if rule == LOWER:
            return low
        if rule == FP32:
            return F
        dyn = [i for i in floats if ins[i] not in self.float_inits]
        if dyn:
            found = {self.cur.get(ins[i], F) for i in dyn}
            return found.pop() if len(found) == 1 else F
        return low if floats else None

    def stored_initializers(self) -> list[Any]:
        """Each float initializer in every dtype its consumers want (the first under its own
        name), the consumers renamed to match; other initializers as they were."""
        from onnx import numpy_helper

        F = self.F
        new_inits = [t for k, t in self.inits.items() if k not in self.float_inits]
        renamed: dict[tuple[str, int], str] = {}
        for name in self.float_inits:
            wanted = self.requests[name] or {F}
            for k, want in enumerate(sorted(wanted)):
                new_name = name if k == 0 else f"{name}__{'fp32' if want == F else 'low'}"
                arr = numpy_helper.to_array(self.inits[name])
                new_inits.append(numpy_helper.from_array(_narrow(arr, want), new_name))
                renamed[(name, want)] = new_name
        for n, i, name, want in self.uses:
            n.input[i] = renamed[(name, want)]
        return new_inits


def _cast_outputs_back(g: Any, new_nodes: list[Any], cur: dict[str, int]) -> list[Any]:
    """A ``Cast`` to float32 for each fp32 graph output the pass made 16-bit (the producing
    node now writes ``<name>__low``)."""
    from onnx import helper

    F = _onnx().TensorProto.FLOAT
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
    return tail


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
