"""Dtype policies: which dtype parameters are stored in, computed in, and returned in.

A :class:`Policy` is three dtypes and the name it was spelled with, parsed from the spellings
users know (Keras, jmp, Lightning, Accelerate, torch dtypes); the global policy is process-wide,
a module's own is stored here (``mixprec.set_policy``). Design: ``docs/design.md``, "Policies".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Union

import torch
from torch import nn

__all__ = [
    "Policy",
    "PolicyLike",
    "get_policy",
    "global_policy",
    "policy_scope",
    "set_global_policy",
]

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "f32": torch.float32,
    "fp32": torch.float32,
    "full": torch.float32,
    "float": torch.float32,
    "32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "f16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "16": torch.float16,
    "float64": torch.float64,
    "f64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
    "64": torch.float64,
}
_CANONICAL = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}
_F32, _BF16, _F16, _F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64

# name -> (param, compute, output). Keras, Lightning/Fabric and Accelerate spellings.
_NAMED: dict[str, tuple[torch.dtype, torch.dtype, torch.dtype]] = {
    "float32": (_F32, _F32, _F32),
    "float16": (_F16, _F16, _F16),
    "bfloat16": (_BF16, _BF16, _BF16),
    "float64": (_F64, _F64, _F64),
    "mixed_float16": (_F32, _F16, _F32),
    "mixed_bfloat16": (_F32, _BF16, _F32),
    "bf16-mixed": (_F32, _BF16, _F32),
    "16-mixed": (_F32, _F16, _F32),
    "bf16-true": (_BF16, _BF16, _BF16),
    "16-true": (_F16, _F16, _F16),
    "32-true": (_F32, _F32, _F32),
    "64-true": (_F64, _F64, _F64),
    "bf16": (_F32, _BF16, _F32),
    "fp16": (_F32, _F16, _F32),
    "no": (_F32, _F32, _F32),
    "half": (_F16, _F16, _F16),
    "full": (_F32, _F32, _F32),
    "32": (_F32, _F32, _F32),
    "16": (_F32, _F16, _F32),
    "64": (_F64, _F64, _F64),
}
_JMP_KEYS = {
    "params": "param",
    "p": "param",
    "compute": "compute",
    "c": "compute",
    "output": "output",
    "o": "output",
}

_HELP = (
    "Accepted: Keras names ('float32', 'float16', 'bfloat16', 'mixed_float16', 'mixed_bfloat16'); "
    "jmp strings ('params=float32,compute=bfloat16,output=float32', short 'p=f32,c=bf16,o=f32', "
    "dtype names f32/bf16/f16/half/full); Lightning/Accelerate ('bf16-mixed', '16-mixed', "
    "'bf16-true', '16-true', '32-true', 'bf16', 'fp16', 'no'); a torch dtype; a Policy; or "
    "keywords Policy(compute_dtype=..., param_dtype=..., output_dtype=...)."
)

PolicyLike = Union["Policy", str, torch.dtype, int]


def _dtype(value: Any, role: str) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in _CANONICAL:
        return value
    if isinstance(value, str) and value.strip().lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.strip().lower()]
    raise _not_a_dtype(value, role)


def _not_a_dtype(value: Any, role: str) -> ValueError:
    if isinstance(value, torch.dtype):  # also float8 etc.: floating for torch, not a policy dtype
        return ValueError(
            f"{role} must be a floating dtype (float32, bfloat16, float16 or "
            f"float64), received {value}. {_HELP}"
        )
    return ValueError(
        f"Cannot read {role}={value!r} as a floating dtype. Use one of "
        f"{sorted(set(_DTYPE_NAMES) - {'16', '32', '64'})} or a torch dtype."
    )


def _parse(spec: Any) -> tuple[tuple[torch.dtype, torch.dtype, torch.dtype], str]:
    if isinstance(spec, Policy):
        return (spec.param_dtype, spec.compute_dtype, spec.output_dtype), spec.name
    if isinstance(spec, torch.dtype):
        d = _dtype(spec, "policy dtype")
        return (d, d, d), _CANONICAL.get(d, str(d))
    if isinstance(spec, bool) or not isinstance(spec, (str, int)):
        raise TypeError(
            f"A policy must be a string, a torch dtype or a Policy; received "
            f"{spec!r} (of type {type(spec).__name__}). {_HELP}"
        )
    text = str(spec).strip()
    key = text.lower()
    if key in _NAMED:
        return _NAMED[key], text
    if "=" in key:
        parts: dict[str, torch.dtype] = {}
        for item in key.split(","):
            k, sep, v = (s.strip() for s in item.partition("="))
            if not sep or k not in _JMP_KEYS:
                raise ValueError(
                    f"Cannot parse policy {spec!r}: {item!r} is not 'key=dtype' with "
                    f"key one of params/compute/output (p/c/o). {_HELP}"
                )
            if _JMP_KEYS[k] in parts:
                raise ValueError(f"Cannot parse policy {spec!r}: {k!r} given twice.")
            parts[_JMP_KEYS[k]] = _dtype(v, k)
        get = parts.get
        return (get("param", _F32), get("compute", _F32), get("output", _F32)), text
    raise ValueError(f"Unknown policy {spec!r}. {_HELP}")


class Policy:
    """An immutable mixed-precision policy.

    Args:
        spec: a Keras, jmp, Lightning or Accelerate spelling, a torch dtype or a Policy.
        compute_dtype: dtype the module computes in (keyword form).
        param_dtype: dtype parameters are stored in (jmp's "params").
        output_dtype: dtype the module returns; defaults to float32.

    Example:
        >>> p = Policy("p=f32,c=bf16,o=f32")
        >>> p.compute_dtype, p == Policy("bf16-mixed")
        (torch.bfloat16, True)
    """

    # order matters: _setstate and __init__ zip values with these names
    __slots__ = ("param_dtype", "compute_dtype", "output_dtype", "name")  # noqa: RUF023
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    output_dtype: torch.dtype
    name: str

    def __init__(
        self,
        spec: PolicyLike | None = None,
        *,
        compute_dtype: Any = None,
        param_dtype: Any = None,
        output_dtype: Any = None,
    ):
        keywords = (compute_dtype, param_dtype, output_dtype)
        if spec is not None:
            if any(k is not None for k in keywords):
                raise ValueError(f"Give a policy spelling ({spec!r}) or dtype keywords, not both.")
            (p, c, o), name = _parse(spec)
        elif all(k is None for k in keywords):
            raise ValueError(f"Policy() needs a spelling or dtype keywords. {_HELP}")
        else:
            c = _dtype(compute_dtype if compute_dtype is not None else _F32, "compute_dtype")
            p = _dtype(param_dtype, "param_dtype") if param_dtype is not None else _F32
            o = _dtype(output_dtype, "output_dtype") if output_dtype is not None else _F32
            name = f"params={_CANONICAL[p]},compute={_CANONICAL[c]},output={_CANONICAL[o]}"
        for slot, value in zip(self.__slots__, (p, c, o, name)):
            object.__setattr__(self, slot, value)

    @property
    def is_mixed(self) -> bool:
        """True when computation runs in a different dtype than parameters are stored in."""
        return self.compute_dtype != self.param_dtype

    @property
    def is_lower(self) -> bool:
        """True when the compute dtype is a 16-bit float."""
        return self.compute_dtype in (torch.float16, torch.bfloat16)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Policy is immutable; build a new one instead of setting {name!r}.")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Policy is immutable.")

    def _key(self) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        return (self.param_dtype, self.compute_dtype, self.output_dtype)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.name, *self._key()))

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        p, c, o = (_CANONICAL[d] for d in self._key())
        return f"Policy({self.name!r}: params={p}, compute={c}, output={o})"


def _rebuild(name: str, p: torch.dtype, c: torch.dtype, o: torch.dtype) -> Policy:
    policy = Policy(param_dtype=p, compute_dtype=c, output_dtype=o)
    object.__setattr__(policy, "name", name)
    return policy


def as_policy(spec: PolicyLike) -> Policy:
    """Return ``spec`` as a Policy (a Policy is returned unchanged)."""
    return spec if isinstance(spec, Policy) else Policy(spec)


_FLOAT32 = Policy("float32")
_global: Policy = _FLOAT32


def global_policy() -> Policy:
    """The process-wide policy (``float32`` until :func:`set_global_policy` is called)."""
    return _global


def set_global_policy(policy: PolicyLike | None) -> None:
    """Set the process-wide policy; ``None`` resets it to ``float32``."""
    global _global  # noqa: PLW0603 - the process-wide policy, as in Keras
    _global = _FLOAT32 if policy is None else as_policy(policy)


@contextlib.contextmanager
def policy_scope(policy: PolicyLike) -> Iterator[Policy]:
    """Use ``policy`` as the global policy inside the block, then restore the previous one."""
    previous = _global
    set_global_policy(policy)
    try:
        yield _global
    finally:
        set_global_policy(previous)


POLICY_ATTR = "_mixprec_policy"  # where set_policy stores a module's policy


def get_policy(module: nn.Module) -> Policy | None:
    """The policy attached to ``module`` by ``mixprec.set_policy``, or None."""
    return getattr(module, POLICY_ATTR, None)
