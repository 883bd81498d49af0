"""The cast table: which ops run in 16-bit (``"lower"``), in float32 (``"fp32"``) or in the widest
input dtype (``"promote"``); unlisted ops run as ``torch.autocast`` runs them. It is data, keyed
by an op's base name, that the eager engine, the graph pass and ``docs/ops.md`` all read, so
they cannot drift apart. Design: ``docs/design.md``, "The cast table".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = [
    "CAST_OPS",
    "DEFAULT_TABLE",
    "DROP_OPS",
    "FP32",
    "FP32_INSIDE_OPS",
    "GRAPH_CLEAR",
    "GRAPH_INFER",
    "LOWER",
    "NATIVE_PROMOTE",
    "PROMOTE",
    "PYTHON_FUNCTIONS",
    "RULES",
    "SOURCE_OPS",
    "cast_rules",
    "current_table",
    "op_name",
    "register_op",
    "rule_for",
    "table_markdown",
]

LOWER, FP32, PROMOTE = "lower", "fp32", "promote"
RULES = (LOWER, FP32, PROMOTE)

_CATEGORIES: dict[str, dict[str, tuple[str, ...]]] = {
    LOWER: {
        "matmul": (
            "linear",
            "matmul",
            "mm",
            "bmm",
            "baddbmm",
            "addmm",
            "addbmm",
            "addmv",
            "addr",
            "mv",
            "einsum",
            "chain_matmul",
            "linalg_multi_dot",
            "_addmm_activation",
        ),
        "convolution": (
            "conv1d",
            "conv2d",
            "conv3d",
            "conv_transpose1d",
            "conv_transpose2d",
            "conv_transpose3d",
            "conv_tbc",
            "convolution",
            "_convolution",
            "prelu",
        ),
        "attention": ("scaled_dot_product_attention", "_native_multi_head_attention"),
        "recurrent": (
            "lstm",
            "gru",
            "rnn_tanh",
            "rnn_relu",
            "lstm_cell",
            "gru_cell",
            "rnn_tanh_cell",
            "rnn_relu_cell",
            "mkldnn_rnn_layer",
        ),
    },
    FP32: {
        "softmax": ("softmax", "log_softmax", "softmin", "_softmax", "_log_softmax", "logsumexp"),
        "normalization": (
            "layer_norm",
            "native_layer_norm",
            "group_norm",
            "rms_norm",
            "local_response_norm",
            "normalize",
        ),
        "reduction": (
            "sum",
            "nansum",
            "mean",
            "nanmean",
            "prod",
            "cumsum",
            "cumprod",
            "std",
            "var",
            "std_mean",
            "var_mean",
            "norm",
            "linalg_norm",
            "linalg_vector_norm",
            "linalg_matrix_norm",
            "frobenius_norm",
            "nuclear_norm",
            "dist",
            "pdist",
            "cdist",
            "renorm",
            "trace",
            "cosine_similarity",
        ),
        "pointwise": (
            "exp",
            "expm1",
            "log",
            "log10",
            "log2",
            "log1p",
            "pow",
            "float_power",
            "reciprocal",
            "rsqrt",
            "acos",
            "asin",
            "cosh",
            "sinh",
            "tan",
            "erfinv",
            "softplus",
        ),
        "loss": (
            "cross_entropy",
            "cross_entropy_loss",
            "nll_loss",
            "nll_loss2d",
            "binary_cross_entropy",
            "binary_cross_entropy_with_logits",
            "mse_loss",
            "l1_loss",
            "smooth_l1_loss",
            "huber_loss",
            "kl_div",
            "poisson_nll_loss",
            "gaussian_nll_loss",
            "cosine_embedding_loss",
            "hinge_embedding_loss",
            "margin_ranking_loss",
            "multilabel_margin_loss",
            "multilabel_soft_margin_loss",
            "multi_margin_loss",
            "soft_margin_loss",
            "triplet_margin_loss",
            "ctc_loss",
        ),
        "linear algebra": (
            "inverse",
            "pinverse",
            "cholesky",
            "linalg_inv",
            "linalg_solve",
            "linalg_cholesky",
            "linalg_eigh",
            "linalg_svd",
            "svd",
            "qr",
        ),
        "fft": (
            "fft_fft",
            "fft_ifft",
            "fft_rfft",
            "fft_irfft",
            "fft_fft2",
            "fft_rfft2",
            "fft_fftn",
            "fft_rfftn",
            "stft",
        ),
    },
    PROMOTE: {
        "binary": (
            "add",
            "sub",
            "rsub",
            "mul",
            "div",
            "true_divide",
            "atan2",
            "maximum",
            "minimum",
            "fmax",
            "fmin",
            "lerp",
            "addcmul",
            "addcdiv",
            "where",
            "dot",
            "vdot",
            "cross",
            "bilinear",
            "tensordot",
            "eq",
            "ne",
            "lt",
            "le",
            "gt",
            "ge",
            "equal",
        ),
        "sequence": ("cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack"),
        "indexing": ("index_put", "index_copy", "scatter_add", "index_add", "masked_scatter"),
    },
}

# The graph pass (:mod:`mixprec.graph`) colours nodes with grappler's four lists: "lower" ops
# are its allow list, "fp32" ops its deny list, and the two sets below split the rest. Eager
# mode needs neither: there an unlisted op runs as torch.autocast runs it.
#
# Clear: no numeric effect (views, data movement, selection, max-type ops, relu, dropout); a clear
# op takes the colour of its neighbours, so casts land at the edges of clear runs.
GRAPH_CLEAR: frozenset[str] = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "view_as",
        "reshape_as",
        "flatten",
        "unflatten",
        "permute",
        "transpose",
        "t",
        "expand",
        "expand_as",
        "squeeze",
        "unsqueeze",
        "slice",
        "select",
        "narrow",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "getitem",
        "clone",
        "contiguous",
        "alias",
        "detach",
        "relu",
        "relu6",
        "hardtanh",
        "max_pool1d",
        "max_pool2d",
        "max_pool3d",
        "max_pool1d_with_indices",
        "max_pool2d_with_indices",
        "max_pool3d_with_indices",
        "adaptive_max_pool1d",
        "adaptive_max_pool2d",
        "dropout",
        "native_dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "feature_dropout",
        "alpha_dropout",
        "pad",
        "constant_pad_nd",
        "reflection_pad1d",
        "reflection_pad2d",
        "replication_pad1d",
        "replication_pad2d",
        "tril",
        "triu",
        "flip",
        "roll",
        "repeat",
        "tile",
        "index_select",
        "gather",
        "take_along_dim",
        "masked_fill",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "neg",
        "abs",
        "sign",
        "max",
        "min",
        "amax",
        "amin",
        "topk",
        "sort",
        "pixel_shuffle",
        "pixel_unshuffle",
        "channel_shuffle",
        "identity",
        "upsample_nearest1d",
        "upsample_nearest2d",
        "interpolate",
        "as_strided",
        "movedim",
        "swapaxes",
        "diagonal",
        "ravel",
    }
)
# Infer: numeric ops that are safe in 16-bit but not worth a cast on their own (activations,
# elementwise math, the "promote" ops): 16-bit only when sandwiched between allow ops.
GRAPH_INFER: frozenset[str] = frozenset(
    {
        "gelu",
        "silu",
        "tanh",
        "sigmoid",
        "hardswish",
        "hardsigmoid",
        "mish",
        "elu",
        "selu",
        "celu",
        "leaky_relu",
        "rrelu",
        "softsign",
        "tanhshrink",
        "logsigmoid",
        "sqrt",
        "square",
        "erf",
        "erfc",
        "sin",
        "cos",
        "clamp",
        "clip",
        "clamp_min",
        "clamp_max",
        "floor",
        "ceil",
        "round",
        "trunc",
        "frac",
        "avg_pool1d",
        "avg_pool2d",
        "avg_pool3d",
        "adaptive_avg_pool1d",
        "adaptive_avg_pool2d",
        "adaptive_avg_pool3d",
        "batch_norm",
        "instance_norm",
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional",
        "_native_batch_norm_legit_no_training",
        "upsample_bilinear2d",
        "upsample_linear1d",
    }
)

# Entries that name Python functions of torch.nn.functional rather than aten ops. torch.export
# (and with it the graph pass) sees such a call whole; the eager engine works on the dispatcher
# and sees only the aten ops the function calls, each under its own rule. A test checks that
# exactly these entries have no aten op; docs/ops.md says what each of them runs in eager mode.
PYTHON_FUNCTIONS: frozenset[str] = frozenset(
    {
        "softmin",
        "normalize",
        "local_response_norm",
        "cross_entropy",
        "gaussian_nll_loss",
        "multilabel_soft_margin_loss",
    }
)

DEFAULT_TABLE: Mapping[str, str] = {
    name: rule
    for rule, groups in _CATEGORIES.items()
    for names in groups.values()
    for name in names
}

_DUNDER = {
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__add__": "add",
    "__radd__": "add",
    "__sub__": "sub",
    "__rsub__": "rsub",
    "__mul__": "mul",
    "__rmul__": "mul",
    "__truediv__": "div",
    "__rtruediv__": "div",
    "__div__": "div",
    "__rdiv__": "div",
    "__pow__": "pow",
    "__rpow__": "pow",
    "__eq__": "eq",
    "__ne__": "ne",
    "__lt__": "lt",
    "__le__": "le",
    "__gt__": "gt",
    "__ge__": "ge",
}
_INPLACE_DUNDER = {
    "__iadd__",
    "__isub__",
    "__imul__",
    "__itruediv__",
    "__idiv__",
    "__ipow__",
    "__imatmul__",
    "__setitem__",
}


def op_name(op: Any) -> tuple[str, bool]:
    """Return ``(base name, is_inplace)`` for a torch function, Tensor method or ``torch.ops`` op.

    ``torch.ops.aten.mm.default`` -> ``("mm", False)``; ``Tensor.add_`` -> ``("add", True)``;
    ``Tensor.__matmul__`` -> ``("matmul", False)``; a plain string is taken as a name.
    """
    if isinstance(op, str):
        name = op
    elif isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = op.__name__.split(".")[0] if isinstance(op, torch._ops.OpOverload) else op.__name__
        name = name.split("::")[-1]
    else:
        name = getattr(op, "__name__", None)
        if not isinstance(name, str):
            raise TypeError(
                f"Cannot name op {op!r} (type {type(op).__name__}): expected a torch "
                "function, a torch.nn.functional function, a Tensor method, a "
                "torch.ops overload or an op name string."
            )
    if name in _INPLACE_DUNDER:
        return name, True
    if name in _DUNDER:
        return _DUNDER[name], False
    if name.endswith("_") and not name.endswith("__") and not name.startswith("_"):
        return name[:-1], True
    return name, False


class _TableState(threading.local):
    def __init__(self) -> None:
        self.scopes: list[dict[str, str | None]] = []


_user: dict[str, str | None] = {}
_scoped = _TableState()
_version = [0]
_merged: list[tuple[int, int, dict[str, str], frozenset[str]]] = []
_listeners: list[Callable[[], None]] = []  # told of every change (the engine's kernel registry)


def _changed() -> None:
    _version[0] += 1
    for listener in _listeners:
        listener()


def _check_rule(rule: Any) -> str | None:
    if rule is not None and rule not in RULES:
        raise ValueError(
            f"Unknown cast rule {rule!r}; expected one of {RULES} (or None to make "
            "the op run in its input dtype)."
        )
    return rule


def register_op(op: Any, rule: str | None) -> None:
    """Set the rule of ``op`` for the rest of the process (all threads).

    Args:
        op: a torch function, a ``torch.nn.functional`` function, a Tensor method, a
            ``torch.ops`` overload or an op name. All spellings of the same op share one entry.
        rule: ``"lower"``, ``"fp32"``, ``"promote"``, or ``None`` (unlisted: input dtype).
    """
    name, _ = op_name(op)
    _user[name] = _check_rule(rule)
    _changed()


@contextlib.contextmanager
def cast_rules(overrides: Mapping[Any, str | None]) -> Iterator[None]:
    """Override rules inside a block (this thread only), e.g. ``{torch.softmax: "lower"}``."""
    scope = {op_name(op)[0]: _check_rule(rule) for op, rule in overrides.items()}
    _scoped.scopes.append(scope)
    _changed()
    try:
        yield
    finally:
        # by identity: list.remove() would drop the first *equal* scope, maybe an outer one
        scopes = _scoped.scopes
        del scopes[next(i for i in range(len(scopes) - 1, -1, -1) if scopes[i] is scope)]
        _changed()


def _effective() -> tuple[dict[str, str], frozenset[str]]:
    """``(current_table(), names explicitly set to None by register_op / cast_rules)``."""
    key = (_version[0], id(_scoped.scopes))
    entry = _merged[0] if _merged else None  # read once: another thread may replace it
    if entry is not None and entry[:2] == key:
        return entry[2], entry[3]
    table: dict[str, str | None] = dict(DEFAULT_TABLE)
    table.update(_user)
    for scope in _scoped.scopes:
        table.update(scope)
    merged = {k: v for k, v in table.items() if v is not None}
    opted_out = frozenset(k for k, v in table.items() if v is None)
    _merged[:] = [(key[0], key[1], merged, opted_out)]
    return merged, opted_out


def current_table() -> dict[str, str]:
    """The effective ``{op name: rule}`` for this thread: defaults, registrations, scopes."""
    return _effective()[0]


def rule_for(op: Any) -> str | None:
    """The rule that applies to ``op`` now, or None when it runs in its input dtype."""
    name, inplace = op_name(op)
    return None if inplace else current_table().get(name)


def table_markdown(
    table: Mapping[str, str] | None = None, marks: Mapping[str, str] | None = None
) -> str:
    """The op table as Markdown (``tools/gen_op_table.py`` writes it into ``docs/ops.md``).

    Args:
        table: ``{op name: rule}``; default :data:`DEFAULT_TABLE`.
        marks: ``{op name: suffix}`` written right after an op's name (a footnote marker).
    """
    table = DEFAULT_TABLE if table is None else table
    marks = marks or {}
    lines = ["| rule | group | ops |", "|---|---|---|"]
    for rule, groups in _CATEGORIES.items():
        for group, names in groups.items():
            ops = ", ".join(f"`{n}`{marks.get(n, '')}" for n in names if table.get(n) == rule)
            if ops:
                lines.append(f"| {rule} | {group} | {ops} |")
    return "\n".join(lines)


def _resolver() -> Callable[[Any], tuple[str, bool]]:
    cache: dict[Any, tuple[str, bool]] = {}

    def resolve(func: Any) -> tuple[str, bool]:
        try:
            return cache[func]
        except (KeyError, TypeError):
            pass
        try:
            result = op_name(func)
        except TypeError:
            result = ("", False)
        with contextlib.suppress(TypeError):  # an unhashable callable: not cached
            cache[func] = result
        return result

    return resolve


resolve_op = _resolver()


# fp32-rule ops whose 16-bit kernels accumulate in float32 internally (CPU and CUDA): with
# ``fp32_inside`` they keep 16-bit inputs and outputs -- the seed's "memory-bound ops stay
# 16-bit in and out, compute in fp32 inside" -- instead of paying for two casts.
# The ATen spellings are listed too: the graph pass reads this set as well.
FP32_INSIDE_OPS = frozenset(
    {
        "layer_norm",
        "group_norm",
        "softmax",
        "log_softmax",
        "native_layer_norm",
        "native_group_norm",
        "_softmax",
        "_log_softmax",
    }
)

# promote-rule ops whose native kernels already compute in the widest input dtype (torch's type
# promotion): they need no cast and no kernel. 0-dim tensors and Python numbers do not widen
# them, as in torch.
NATIVE_PROMOTE = frozenset(
    {
        "add",
        "sub",
        "rsub",
        "mul",
        "div",
        "true_divide",
        "atan2",
        "maximum",
        "minimum",
        "fmax",
        "fmin",
        "addcmul",
        "addcdiv",
        "where",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "equal",
        "cat",
        "concat",
        "concatenate",
        "stack",
        "hstack",
        "vstack",
        "dstack",
    }
)


# -- structural op sets of the graph pass (mixprec.graph.paint, mixprec.graph.casts) --------
# ops whose result has an input's storage dtype by construction (gather from a table): the cast
# goes on the (small) output instead of the (large) weight
SOURCE_OPS = frozenset({"embedding", "embedding_bag", "_embedding_bag"})
CAST_OPS = frozenset(
    {
        "_to_copy",
        "to",
        "float",
        "half",
        "bfloat16",
        "double",
        "type",
        "convert_element_type",
        "_convert_element_type",
    }
)
DROP_OPS = frozenset({"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size"})
