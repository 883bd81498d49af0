"""Alignment lint: dimensions that keep 16-bit matmuls off the tensor cores (or AMX tiles).

``print(mixprec.numerics.lint(model, torch.bfloat16, batch_size=16, seq_len=256))``

Design (NVIDIA's "Deep Learning Performance" guide on GEMM dimension alignment; the seed
``000_...`` names alignment as one of AMP's two hard parts):

* A 16-bit GEMM runs on tensor cores only when its M, N and K are multiples of 8 elements
  (16 bytes); on TPUs the MXU tiles are 128 wide; on Intel AMX a bf16 tile row is 32 elements
  and tiles have 16 rows, so 16 is the useful multiple there. ``target`` picks the rule.
* Checked: ``nn.Linear`` in/out features (K, N), conv in/out channels per group, embedding
  width, the vocabulary of an embedding tied to the output projection, RNN input/hidden sizes,
  attention embed and head dims (``nn.MultiheadAttention`` and modules with ``n_head`` /
  ``num_heads`` attributes), and the tokens per batch (M: ``batch_size * seq_len``) when given.
  A vocabulary is reported once, on the output projection (the GEMM that costs).
* The fix pads to the required multiple, or for large dims (>= 1024, e.g. vocabularies) to the
  next multiple of 64 on GPUs -- "pad vocab from 50257 to 50304" -- which costs < 0.2% extra
  work and aligns to the 128-byte cache line.
* float32 (and float64) have no alignment rule worth linting: the report is empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["LintFinding", "LintReport", "lint"]

_TARGETS = {"gpu": (8, 64), "tpu": (128, 128), "cpu": (16, 64)}
_LARGE = 1024
_HEAD_ATTRS = ("n_head", "num_heads", "num_attention_heads", "n_heads")
_WIDTH_ATTRS = ("embed_dim", "n_embd", "hidden_size", "d_model")


@dataclass(frozen=True)
class LintFinding:
    """One misaligned dimension and its fix."""

    module: str  # dotted path ("" is the model)
    kind: str  # module type, e.g. "Linear"
    dim: str  # e.g. "out_features", "vocab_size", "tokens per batch"
    value: int
    multiple: int
    suggested: int

    @property
    def message(self) -> str:
        what = "vocab" if self.dim == "vocab_size" else self.dim
        return (
            f"{self.module or '<model>'} ({self.kind}): {self.dim}={self.value} is not a "
            f"multiple of {self.multiple}; pad {what} from {self.value} to {self.suggested}"
        )


@dataclass
class LintReport:
    """The findings of :func:`lint`; ``str(report)`` is a readable list."""

    dtype: torch.dtype
    target: str
    multiple: int
    findings: list[LintFinding]

    def __bool__(self) -> bool:
        return bool(self.findings)

    def __len__(self) -> int:
        return len(self.findings)

    def as_dict(self) -> dict[str, Any]:
        return {
            "dtype": str(self.dtype).replace("torch.", ""),
            "target": self.target,
            "multiple": self.multiple,
            "findings": [
                {
                    "module": f.module,
                    "kind": f.kind,
                    "dim": f.dim,
                    "value": f.value,
                    "multiple": f.multiple,
                    "suggested": f.suggested,
                    "message": f.message,
                }
                for f in self.findings
            ],
        }

    def __str__(self) -> str:
        name = str(self.dtype).replace("torch.", "")
        if not self.findings:
            return f"lint ({name}, {self.target}): every checked dimension is aligned"
        lines = [
            f"lint ({name}, {self.target}, multiples of {self.multiple}): "
            f"{len(self.findings)} misaligned dimension(s)"
        ]
        return "\n".join([*lines, *("  " + f.message for f in self.findings)])


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def lint(
    model: nn.Module,
    dtype: torch.dtype | str = torch.bfloat16,
    *,
    target: str = "gpu",
    batch_size: int | None = None,
    seq_len: int | None = None,
) -> LintReport:
    """Flag dimensions that are not multiples of the tensor-core tile for ``dtype`` on ``target``.

    Args:
        model: the model to inspect (not run).
        dtype: the 16-bit compute dtype (a dtype or a name such as ``"bf16"``).
        target: ``"gpu"`` (multiples of 8), ``"tpu"`` (128) or ``"cpu"`` (16, Intel AMX).
        batch_size, seq_len: optional hints; their product is the M of every matmul.

    Returns:
        A :class:`LintReport`; each finding says how to pad.
    """
    from mixprec._core.policy import Policy

    if not isinstance(model, nn.Module):
        raise TypeError(f"lint expects an nn.Module, received {type(model).__name__}.")
    if target not in _TARGETS:
        raise ValueError(f"target={target!r} is not one of {sorted(_TARGETS)}.")
    if not isinstance(dtype, torch.dtype):
        dtype = Policy(compute_dtype=dtype).compute_dtype
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int or None, received {v!r}.")
    multiple, preferred = _TARGETS[target]
    report = LintReport(dtype, target, multiple, [])
    if dtype not in (torch.float16, torch.bfloat16):
        return report
    report.findings.extend(_module_findings(model, target, multiple, preferred))
    if batch_size is not None:
        tokens = batch_size * (seq_len or 1)
        dim = "tokens per batch (batch_size*seq_len)" if seq_len else "batch_size"
        if tokens % multiple:
            report.findings.append(
                LintFinding(
                    "", type(model).__name__, dim, tokens, multiple, _round_up(tokens, multiple)
                )
            )
    return report


def _module_findings(
    model: nn.Module, target: str, multiple: int, preferred: int
) -> list[LintFinding]:
    """One finding per (module, dimension) that is not a multiple of ``multiple``."""
    tied = {}  # id(weight) -> embedding path, for vocabularies tied to an output projection
    for path, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            tied[id(m.weight)] = path
    findings: list[LintFinding] = []
    seen: set[tuple[str, str]] = set()
    for path, m in model.named_modules():
        for dim, value in _dims(m, tied):
            if value % multiple == 0 or (path, dim) in seen:
                continue
            seen.add((path, dim))
            to = preferred if value >= _LARGE and target == "gpu" else multiple
            findings.append(
                LintFinding(path, type(m).__name__, dim, value, multiple, _round_up(value, to))
            )
    return findings


def _dims(m: nn.Module, tied: dict[int, str]) -> list[tuple[str, int]]:
    """The (name, size) of each dimension of ``m`` that feeds a matmul, in report order."""
    if isinstance(m, nn.MultiheadAttention):
        return [("embed_dim", m.embed_dim), ("head_dim", m.head_dim)]
    if isinstance(m, nn.Linear):
        out = "vocab_size" if id(m.weight) in tied else "out_features"
        dims = [("in_features", m.in_features), (out, m.out_features)]
    elif isinstance(m, nn.modules.conv._ConvNd):
        dims = [
            ("in_channels per group", m.in_channels // m.groups),
            ("out_channels per group", m.out_channels // m.groups),
        ]
    elif isinstance(m, nn.Embedding):
        dims = [("embedding_dim", m.embedding_dim)]
    elif isinstance(m, nn.RNNBase):
        dims = [("input_size", m.input_size), ("hidden_size", m.hidden_size)]
    else:
        dims = []
    head_dim = _head_dim(m)
    if head_dim is not None:
        dims.append(("head_dim", head_dim))
    return dims


def _head_dim(m: nn.Module) -> int | None:
    """An attention block's width per head, from its head-count and width attributes (or its
    first Linear's input width); None when ``m`` names no head count."""
    heads = next((getattr(m, a) for a in _HEAD_ATTRS if isinstance(getattr(m, a, None), int)), None)
    if not heads:
        return None
    width = next(
        (getattr(m, a) for a in _WIDTH_ATTRS if isinstance(getattr(m, a, None), int)), None
    )
    if width is None:
        first = next((c for c in m.modules() if isinstance(c, nn.Linear)), None)
        width = first.in_features if first is not None else None
    if width and width % heads == 0:
        return width // heads
    return None
