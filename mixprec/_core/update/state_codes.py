"""Optimizer states in 8 or 4 bits: block-wise scaled minifloat codes.

Each block of :data:`BLOCK` elements of one row (an index of dimension 0, so FSDP2's shards
have the same blocks) keeps one fp32 scale, its largest magnitude; each element is a small
float relative to it (first moments signed, E4M3 in 8 bits as torch's ``float8_e4m3fn``;
second moments as their square root, rounded up rather than to zero), read off the fp32 bit
pattern with integer shifts and rounded to nearest. Tensors under :data:`MIN_NUMEL` elements
or of one dimension stay fp32. ``docs/design.md``, "Optimizer states in fewer bits".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "BLOCK",
    "FORMATS",
    "MIN_NUMEL",
    "SECOND_MOMENTS",
    "QuantizedState",
    "StateDtype",
    "StatePolicy",
    "fp32_optimizer_state_dict",
    "kind_of",
    "quantizable",
    "store_state",
]

BLOCK = 256
MIN_NUMEL = 4096
#: format -> (bits per code, {kind: (exponent bits, mantissa bits)})
FORMATS: dict[str, tuple[int, dict[str, tuple[int, int]]]] = {
    "8-bit": (8, {"signed": (4, 3), "sqrt": (4, 4)}),
    "4-bit": (4, {"signed": (2, 1), "sqrt": (3, 1)}),
}
#: optimizer state names that hold squares (non-negative, wide range): stored as square roots
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta", "exp_inf")


def quantizable(t: Tensor) -> bool:
    """Whether a state tensor of ``t``'s shape is stored in codes (see the module docstring)."""
    return t.dim() >= 2 and t.numel() >= MIN_NUMEL


def kind_of(key: str) -> str:
    """``"sqrt"`` for a second-moment state name, ``"signed"`` otherwise."""
    return "sqrt" if key in SECOND_MOMENTS else "signed"


def _layout(fmt: str, kind: str) -> tuple[int, int, int, int]:
    """(bits, magnitude bits, mantissa bits, lowest binade exponent) of ``fmt``/``kind``.

    Magnitude codes 1 .. 2**B - 1 are the fp32 bit patterns of ``2**e * (1 + f / 2**M)``
    offset so that the largest code lies in the binade [0.5, 1)."""
    bits, kinds = FORMATS[fmt]
    e, m = kinds[kind]
    mag = bits - 1 if kind == "signed" else bits
    assert e + m == mag, (fmt, kind)
    top = (2**mag - 2) >> m  # binades above the lowest
    return bits, mag, m, -1 - top


def _largest(mag: int, m: int, emin: int) -> float:
    t = 2**mag - 2
    return 2.0 ** (emin + (t >> m)) * (1 + (t & (2**m - 1)) / 2**m)


_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = 448.0
_TINY = 2.0**-100


def _encode_(x: Tensor, mag: int, m: int, emin: int, signed: bool) -> Tensor:
    """Magnitude codes of ``x`` >= 0 (already divided by the block scale), in place in ``x``'s
    memory as int32. ``(bits + half - offset) >> shift`` rounds to nearest and counts binades
    from the lowest in one shift; below the lowest, signed codes go to 0 (zero) and square
    roots to 1 (the smallest value)."""
    shift = 23 - m
    i = x.view(torch.int32)
    i.add_((1 << (shift - 1)) - (((127 + emin) << m) - 1 << shift)).bitwise_right_shift_(shift)
    return i.clamp_(0 if signed else 1, 2**mag - 1)


def _decode_(code: Tensor, m: int, emin: int) -> Tensor:
    """fp32 magnitudes of int32 ``code`` in place (code 0 decodes to 0 only where masked)."""
    code.add_(((127 + emin) << m) - 1).bitwise_left_shift_(23 - m)
    return code.view(torch.float32)


@dataclasses.dataclass(eq=False)
class QuantizedState:
    """One optimizer state tensor held as codes and per-block scales.

    ``codes``: uint8, one per element (two per byte in ``"4-bit"``); ``scale``: fp32, one per
    block; ``shape``, ``fmt`` (a key of :data:`FORMATS`) and ``kind`` (``"signed"`` or
    ``"sqrt"``). Build one with :meth:`quantize`; read it with :meth:`dequantize`.
    """

    codes: Tensor
    scale: Tensor
    shape: torch.Size
    fmt: str
    kind: str

    @classmethod
    def quantize(cls, x: Tensor, fmt: str, kind: str) -> QuantizedState:
        """``x`` (floating) in ``fmt``; with ``kind="sqrt"`` its square root is stored."""
        if fmt not in FORMATS:
            raise ValueError(f"Unknown state format {fmt!r}; expected one of {list(FORMATS)}.")
        return cls.empty(x.shape, fmt, kind, x.device).store_(x)

    @classmethod
    def empty(
        cls, shape: torch.Size | tuple[int, ...], fmt: str, kind: str, device: torch.device
    ) -> QuantizedState:
        """A state of ``shape`` in ``fmt`` whose codes and scales are not written yet."""
        bits = FORMATS[fmt][0]
        rows = _rows(shape)
        blocks = rows[0] * -(-rows[1] // BLOCK)
        n = torch.Size(shape).numel()
        codes = torch.empty(-(-n * bits // 8), dtype=torch.uint8, device=device)
        scale = torch.empty(blocks, dtype=torch.float32, device=device)
        return cls(codes, scale, torch.Size(shape), fmt, kind)

    @classmethod
    def zeros(
        cls, shape: torch.Size | tuple[int, ...], fmt: str, kind: str, device: torch.device
    ) -> QuantizedState:
        """A state of ``shape`` in ``fmt`` holding zeros: zero codes, zero block scales."""
        q = cls.empty(shape, fmt, kind, device)
        q.codes.zero_()
        q.scale.zero_()
        return q

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    @torch.no_grad()
    def store_(self, x: Tensor) -> QuantizedState:
        """Quantize ``x`` (this state's shape) into this state's codes and scales, in place.
        ``x`` may be overwritten: it is a temporary of the step."""
        if x.shape != self.shape:
            raise ValueError(
                f"Cannot store a {tuple(x.shape)} tensor in a {tuple(self.shape)} state."
            )
        v = _blocked(x.detach(), self.shape)  # a view of x where no padding is needed
        if self.kind == "sqrt":
            v = v.clamp_(min=0).sqrt_()  # a square: rounding noise below 0 is 0
        amax = v.amax(dim=-1, keepdim=True)  # no |v| temporary; aminmax is 30x slower on a CPU
        if self.kind == "signed":
            amax = torch.maximum(amax, v.amin(dim=-1, keepdim=True).neg_())
        # a block below 2**-100 is zero: its reciprocal scale would overflow to inf (a first
        # moment decaying over many steps without gradient reaches fp32's subnormals)
        amax.masked_fill_(amax < _TINY, 0.0)
        bits, mag, m, emin = _layout(self.fmt, self.kind)
        if self.fmt == "8-bit" and self.kind == "signed":  # torch's own E4M3 cast
            self.scale.copy_(amax.view(-1)).div_(_E4M3_MAX)
            v.mul_(torch.where(amax > 0, _E4M3_MAX / amax, 0.0)).clamp_(-_E4M3_MAX, _E4M3_MAX)
            _unblocked(self.codes.view(_E4M3).view(self.shape), self.shape).copy_(
                _unblocked(v, self.shape)
            )
            return self
        scale = amax.div_(_largest(mag, m, emin))
        self.scale.copy_(scale.view(-1))
        sign = (v < 0).to(torch.int32) << mag if self.kind == "signed" else None
        code = _encode_(v.abs_().mul_(torch.where(scale > 0, 1 / scale, 0.0)), mag, m, emin,
                        sign is not None)  # fmt: skip
        if sign is not None:
            code |= sign
        _store_codes(self.codes, _unblocked(code, self.shape), bits)
        return self

    @torch.no_grad()
    def dequantize(self, out: Tensor | None = None) -> Tensor:
        """The fp32 values, written into ``out`` (fp32, this state's shape) when given."""
        if out is None:
            out = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        bits, mag, m, emin = _layout(self.fmt, self.kind)
        blocks = _blocked(out, self.shape)
        padded = blocks.data_ptr() != out.data_ptr() or blocks.numel() != out.numel()
        scale = self.scale.view(*blocks.shape[:-1], 1)
        if self.fmt == "8-bit" and self.kind == "signed":
            out.copy_(self.codes.view(_E4M3).view(self.shape))
            if padded:
                blocks = _blocked(out, self.shape)
            blocks.mul_(scale)
        else:
            code = out.view(torch.int32)
            _load_codes(code, self.codes, bits)
            if padded:
                blocks = _blocked(out, self.shape)
            sign = (blocks.view(torch.int32) >> mag).bool() if self.kind == "signed" else None
            icode = blocks.view(torch.int32)
            if sign is not None:
                icode.bitwise_and_(2**mag - 1)
            zero = icode == 0 if sign is not None else None
            vals = _decode_(icode, m, emin).mul_(scale)
            if sign is not None:
                vals.masked_fill_(zero, 0.0).mul_(1 - 2 * sign.to(torch.float32))
            else:
                vals.square_()
            blocks = vals
        if padded:
            out.copy_(_unblocked(blocks, self.shape).reshape(self.shape))
        return out

    # -- checkpoints: tensors and ints, which torch.load(weights_only=True) reads and torch's
    # Optimizer.load_state_dict passes through (it would rebuild a string from its characters)
    def to_dict(self) -> dict[str, Any]:
        return {
            "codes": self.codes,
            "scale": self.scale,
            "shape": list(self.shape),
            "bits": FORMATS[self.fmt][0],
            "sqrt": int(self.kind == "sqrt"),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], device: torch.device | None = None) -> QuantizedState:
        fmt = {b: f for f, (b, _) in FORMATS.items()}[int(d["bits"])]
        return cls(
            d["codes"].to(device=device, dtype=torch.uint8, copy=True),
            d["scale"].to(device=device, dtype=torch.float32, copy=True),
            torch.Size(d["shape"]),
            fmt,
            "sqrt" if d["sqrt"] else "signed",
        )

    @staticmethod
    def is_dict(v: Any) -> bool:
        """True for :meth:`to_dict`'s output."""
        return isinstance(v, dict) and {"codes", "scale", "shape", "bits", "sqrt"} <= set(v)

    def __deepcopy__(self, memo: dict) -> QuantizedState:
        return QuantizedState(
            self.codes.clone(), self.scale.clone(), self.shape, self.fmt, self.kind
        )


# --------------------------------------------------------------------------- layout helpers


def _rows(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """(rows, row length): a row is one index of dimension 0 (a 1-D tensor is one row)."""
    n = torch.Size(shape).numel()
    rows = shape[0] if len(shape) > 1 else 1
    return rows, (n // rows if rows else 0)


def _blocked(x: Tensor, shape: torch.Size) -> Tensor:
    """``x`` as (rows, blocks per row, BLOCK), the last block of each row zero-padded."""
    rows, last = _rows(shape)
    x = x.reshape(rows, last)
    pad = -last % BLOCK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(rows, -1, BLOCK)


def _unblocked(x: Tensor, shape: torch.Size) -> Tensor:
    rows, last = _rows(shape)
    return x.reshape(rows, -1)[:, :last]


def _store_codes(codes: Tensor, code: Tensor, bits: int) -> None:
    """Write int32 ``code`` (rows x row length) into the uint8 ``codes``."""
    if bits == 8:
        codes.view(code.shape).copy_(code)
        return
    flat = code.reshape(-1)
    n = flat.numel()
    pairs = flat[: n - n % 2].view(-1, 2)
    high = pairs[:, 1].bitwise_left_shift_(4)  # in place: the codes are a temporary
    codes[: n // 2].copy_(high.bitwise_or_(pairs[:, 0]))
    if n % 2:
        codes[-1:].copy_(flat[-1:])


def _load_codes(out: Tensor, codes: Tensor, bits: int) -> None:
    """Write the codes as int32 into ``out`` (this state's shape)."""
    if bits == 8:
        out.copy_(codes.view(out.shape))
        return
    flat, n = out.view(-1), out.numel()
    pairs = flat[: n - n % 2].view(-1, 2)  # strided writes: no stacked temporary
    pairs[:, 0].copy_(codes[: n // 2]).bitwise_and_(15)
    pairs[:, 1].copy_(codes[: n // 2]).bitwise_right_shift_(4)
    if n % 2:
        flat[-1:].copy_(codes[-1:]).bitwise_and_(15)


StateDtype = str | torch.dtype | dict | tuple | None
FIRST_MOMENTS = ("exp_avg", "momentum_buffer")  # held in 16 bits by "auto"


class StatePolicy:
    """How each optimizer state is stored under an update mode: called as ``policy(key, param
    dtype)``, it returns a dtype or a format of this module (``"8-bit"``, ``"4-bit"``).

    ``state_dtype``: ``"auto"`` / None (first moments in the parameter's 16-bit dtype, the rest
    fp32), one kind for every state, or ``{state key: kind}`` or its items (unlisted keys
    fp32). A class, not a closure, so an optimizer holding it pickles (``copy.deepcopy``).
    """

    def __init__(self, state_dtype: StateDtype) -> None:  # checked by the recipe's rules
        auto = state_dtype is None or state_dtype == "auto"
        self.table = dict(state_dtype) if isinstance(state_dtype, (dict, tuple)) else None
        self.every = None if auto or self.table is not None else state_dtype

    def __call__(self, key: str, low: torch.dtype) -> Any:
        if self.every is not None:
            return self.every
        if self.table is not None:
            return self.table.get(key, torch.float32)
        return low if key in FIRST_MOMENTS else torch.float32


def store_state(key: str, v: Tensor, fmt: str, prev: Any) -> QuantizedState:
    """Optimizer state ``key``'s stepped value ``v`` stored in ``fmt``: into ``prev``'s codes
    when it has that layout. ``v`` is overwritten unless it is ``prev`` itself (a state kept
    as a tensor, e.g. loaded in fp32), which is copied first."""
    if v is prev or v.dtype != torch.float32:
        v = v.detach().to(torch.float32, copy=True)
    kind = kind_of(key)
    if isinstance(prev, QuantizedState) and (prev.fmt, prev.kind, prev.shape) == (
        fmt,
        kind,
        v.shape,
    ):
        return prev.store_(v)
    return QuantizedState.quantize(v, fmt, kind)


# --------------------------------------------------------------------------- plain torch


def fp32_optimizer_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict that a plain torch optimizer loads: every quantized state as a
    float32 tensor, and mixprec's own entry (``param_groups[0]["mixprec"]``) removed.

    ``state_dict`` is what the optimizer :func:`mixprec.initialize` returned saved
    (``opt.state_dict()``); users reach this as ``opt.fp32_state_dict(state_dict)``. The
    values are the ones the next step would have used (decoded codes); the input is not
    modified.
    """
    from mixprec._core.resume import split_state_dict

    inner, _ = split_state_dict(state_dict)
    state = {
        i: {
            k: QuantizedState.from_dict(v).dequantize() if QuantizedState.is_dict(v) else v
            for k, v in st.items()
        }
        for i, st in inner["state"].items()
    }
    return {**inner, "state": state}
