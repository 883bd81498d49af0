"""Gradients coded in 8 bits as they complete (``Recipe(gradients="coded")``): clipping and
accumulation at a byte per parameter instead of the 16-bit gradient's two.

Design. A held 16-bit gradient costs 2 bytes per parameter from its backward to the step; a
released one costs nothing but allows neither a global-norm clip (the norm needs every
gradient) nor accumulation over micro-batches. Here each 16-bit parameter's gradient, as its
backward completes it (a post-accumulate-grad hook), is

1. checked for inf/NaN, and its norm taken from the 16-bit values as torch's
   ``clip_grad_norm_`` takes it (``_foreach_norm`` where torch uses it, else ``vector_norm``),
   so a clip over coded gradients sees the global norm torch would compute;
2. coded as FP8 E4M3 with a float32 scale per block of 256 elements (the block's largest
   magnitude maps to 448, E4M3's largest): 1 + 4/256 bytes per element, a relative error of
   at most 2**-4 for a value within the block's normal range, and the 16-bit gradient freed.

A second gradient of the same parameter before the step (accumulation) is added to the decoded
codes in fp32 and coded again with stochastic rounding (uniform noise of one code step added
before rounding to nearest), so the sum of many micro-batches carries no rounding bias; its
norm is then the norm of that sum in the gradient's dtype. ``torch.nn.utils.clip_grad_norm_``
over the model's parameters (and ``opt.clip_grad_norm_``) returns the total norm and records
the clip coefficient; the step decodes each parameter's codes, multiplies by the coefficient,
rounds to the weight's dtype and steps it alone, then frees it: the fp32 gradient exists for
one parameter at a time. A non-finite gradient skips the whole step (weights, states and the
loss scaler's rules as with held gradients); its codes are dropped with the others.

What it changes in the numerics against held 16-bit gradients: one extra rounding of each
gradient (E4M3 within its block's scale: at most 2**-4 relative where bf16 has 2**-8), and under
accumulation the stochastic rounding of each partial sum. Loss scaling is not taken (the codes
would hold scaled values across the scaler's decision): an fp16 recipe keeps its gradients held.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._foreach_utils import _has_foreach_support

__all__ = ["BLOCK", "CodedGradient", "CodedGradients", "code", "decode", "empty_codes"]

BLOCK = 256
_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = 448.0
_MANTISSA = 3  # E4M3's mantissa bits


class CodedGradient:
    """One parameter's gradient as FP8 E4M3 codes with a float32 scale per :data:`BLOCK`."""

    __slots__ = ("codes", "dtype", "norm", "scales", "shape")

    def __init__(
        self, codes: Tensor, scales: Tensor, shape: torch.Size, dtype: torch.dtype, norm: Tensor
    ):
        self.codes, self.scales, self.shape, self.dtype, self.norm = (
            codes,
            scales,
            shape,
            dtype,
            norm,
        )

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4


#: elements coded at a time, through a float32 chunk kept from step to step (1 MiB): few torch
#: calls per gradient, and nothing gradient-sized made and freed in backward
CHUNK = 1024 * BLOCK


def empty_codes(numel: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Codes and block scales for a gradient of ``numel`` elements (written by :func:`code`)."""
    blocks = -(-numel // BLOCK)
    codes = torch.empty(blocks * BLOCK, dtype=_E4M3, device=device)
    return codes, torch.empty(blocks, dtype=torch.float32, device=device)


class Scratch(NamedTuple):
    """Buffers kept for coding and decoding on one device: a float32 chunk, its int32 code
    indices, and E4M3's 256 values (a table: the dtype's own conversion is 5x slower on a CPU)."""

    values: Tensor
    index: Tensor
    table: Tensor

    @classmethod
    def on(cls, device: torch.device, numel: int = CHUNK, table: Tensor | None = None) -> Scratch:
        """Buffers of ``numel`` elements on ``device``; ``table``: one made before there (a
        copy to a GPU per gradient would wait for the host)."""
        if table is None:
            table = torch.arange(256, dtype=torch.uint8).view(_E4M3).float().to(device)
        return cls(
            torch.empty(numel, device=device),
            torch.empty(numel, dtype=torch.int32, device=device),
            table,
        )

    def decode_(self, codes: Tensor, out: Tensor) -> Tensor:
        """``codes`` (E4M3, flat) as float32 values written into ``out``."""
        index = self.index[: codes.numel()]
        index.copy_(codes.view(torch.uint8))
        return torch.index_select(self.table, 0, index, out=out)


def code(
    g: Tensor,
    out: tuple[Tensor, Tensor],
    generator: torch.Generator | None = None,
    add: bool = False,
    scratch: Scratch | None = None,
    c_loop: bool = False,
) -> bool | None:
    """Write ``g`` (any float dtype) into ``out`` = (E4M3 codes, float32 block scales); with
    ``add``, ``g`` plus what ``out`` holds; with ``generator``, stochastically rounded (noise of
    one code step, see the module docstring). A chunk at a time, in place, through ``scratch``
    (made here when not given); ``c_loop``: in one C pass on a CPU where it can (the same
    arithmetic, op for op: nearest rounding, nothing added), which also says whether every
    value was finite (returned; None where the torch ops ran)."""
    codes, scales = out
    flat = g.detach().reshape(-1)
    n = flat.numel()
    if c_loop and not add and generator is None:
        from mixprec._core.update.c_loop import code_grad

        finite = code_grad(flat, codes.view(torch.uint8), scales)
        if finite is not None:
            return finite
    if scratch is None:
        scratch = Scratch.on(g.device, min(CHUNK, -(-n // BLOCK) * BLOCK))
    step = scratch.values.numel()  # a multiple of BLOCK
    for start in range(0, n, step):
        m = min(step, n - start)
        size = -(-m // BLOCK) * BLOCK
        y, c = scratch.values[:size], codes[start : start + size]
        s = scales[start // BLOCK : start // BLOCK + size // BLOCK]
        if add:  # what the codes hold, plus g
            scratch.decode_(c, y).view(-1, BLOCK).mul_(s.unsqueeze(1))
            y[:m].add_(flat[start : start + m])
        else:
            y[:m].copy_(flat[start : start + m])
            y[m:].zero_()  # the last block's padding
        y = y.view(-1, BLOCK)
        torch.amax(y, dim=1, out=s)
        torch.maximum(s, y.amin(dim=1).neg_(), out=s)  # the block's largest magnitude
        s.div_(_E4M3_MAX).masked_fill_(s == 0, 1.0)
        y.div_(s.unsqueeze(1))
        if generator is not None:
            _dither_(y, generator)
        c.view(-1, BLOCK).copy_(y)
    return None


def _dither_(y: Tensor, generator: torch.Generator) -> None:
    """Add uniform noise of one E4M3 code step at each value (2**(exponent - 3); the subnormal
    step below 2**-6): rounding to nearest after it rounds stochastically."""
    step = torch.exp2(torch.floor(torch.log2(y.abs().clamp_(min=2.0**-6))) - _MANTISSA)
    noise = torch.rand(y.shape, generator=generator, device=y.device).sub_(0.5)
    y.add_(noise.mul_(step)).clamp_(-_E4M3_MAX, _E4M3_MAX)


def decode(codes: Tensor, scales: Tensor, shape: torch.Size) -> Tensor:
    """The float32 gradient of ``shape`` that :func:`code` coded."""
    flat = (codes.view(-1, BLOCK).float() * scales.unsqueeze(1)).reshape(-1)
    return flat[: shape.numel()].view(shape)


def torch_norm(g: Tensor, norm_type: float, out: Tensor) -> Tensor:
    """``g``'s norm as ``torch.nn.utils.clip_grad_norm_`` computes it for one gradient, written
    into ``out`` (a 0-d tensor of ``g``'s dtype)."""
    if _has_foreach_support([g], g.device):
        return out.copy_(torch._foreach_norm([g], norm_type)[0])
    return torch.linalg.vector_norm(g, norm_type, out=out)


class CodedGradients:
    """The coded half of :class:`~mixprec._core.update.modes.ModeUpdater` (a mixin: it reads
    the updater's ``seed``, ``steps``, ``_ordinal`` and ``fused``)."""

    fused: Any
    seed: int
    steps: int
    _ordinal: dict[int, int]

    def _init_codes(self) -> None:
        self._codes: dict[int, CodedGradient] = {}  # id(param) -> its coded gradient
        self._code_buffers: dict[int, tuple] = {}  # id(param) -> ((codes, scales), norm)
        self._chunk_scratch: dict[torch.device, Scratch] = {}
        self._grad_buffer: dict[tuple, Tensor] = {}  # the decoded gradient, one at a time
        self._coded_found: dict[torch.device, Tensor] = {}  # non-finite flags, per device
        self.clip_coef: Tensor | None = None  # set by a clip of the coded gradients
        self.norm_type = 2.0

    @torch.no_grad()
    def _code_grad(self, p: Tensor) -> None:
        """The post-accumulate-grad hook: code ``p``'s fresh gradient (added to its codes when
        it has some: an accumulation) and free it."""
        g = p.grad
        if g is None:
            return
        if g.is_sparse:
            raise RuntimeError("gradients='coded' needs dense gradients; use gradients='held'.")
        buf, norm = self._buffers_for(p, g)
        scratch = self._scratch_for(g.device, g.numel())
        if id(p) not in self._codes:
            torch_norm(g, self.norm_type, norm)
            finite = code(g, buf, scratch=scratch, c_loop=self._c_loop(g.device))
        else:  # accumulation: the fp32 sum, stochastically rounded; its norm in g's dtype
            finite = None
            code(g, buf, self._generator(p, g.device), True, scratch)
            torch_norm(self._decoded(buf, p.shape, g.dtype), self.norm_type, norm)
        self._check(g, finite)  # the C pass that coded it said; else one pass of its own
        self._codes[id(p)] = CodedGradient(*buf, p.shape, g.dtype, norm)
        p.grad = None

    def _check(self, g: Tensor, finite: bool | None = None) -> None:
        """Record whether ``g`` holds an inf/NaN (``finite``: already known, from the C pass
        that coded it): on a CPU one pass with no temporary (the C loop's check; a
        gradient-sized temporary per parameter would leave heap holes), on other devices a flag
        on the device (no host sync in backward)."""
        flag = self._coded_found.get(g.device)
        if flag is None:
            flag = self._coded_found[g.device] = torch.zeros((), device=g.device)
        if finite is not None:
            if not finite:
                flag.fill_(1.0)
        elif g.device.type == "cpu":
            if not self.fused.finite(g):
                flag.fill_(1.0)
        else:
            flag.add_((~torch.isfinite(g)).any())

    def _buffers_for(self, p: Tensor, g: Tensor) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """``p``'s codes and the 0-d tensor its norm goes to, kept from step to step: made
        once, so the backward allocates nothing that outlives it between autograd's own tensors
        (a small tensor left in a freed gradient's place splits it, and the C heap grows)."""
        buf = self._code_buffers.get(id(p))
        if buf is None or buf[0][0].numel() < g.numel() or buf[0][0].device != g.device:
            norm = torch.zeros((), dtype=g.dtype, device=g.device)
            buf = self._code_buffers[id(p)] = (empty_codes(g.numel(), g.device), norm)
        if buf[1].dtype != g.dtype:
            buf = self._code_buffers[id(p)] = (buf[0], buf[1].to(g.dtype))
        return buf

    def _generator(self, p: Tensor, device: torch.device) -> torch.Generator:
        """The accumulation's noise: seeded by (seed, step, parameter), so a rerun repeats it."""
        key = (self.seed * 1_000_003 + self.steps) * 1_000_033 + self._ordinal.get(id(p), 0)
        return torch.Generator(device=device).manual_seed(key % (2**63))

    def coded_flags(self) -> list[Tensor]:
        """This step's non-finite flags of coded gradients (read with the other verdicts)."""
        return list(self._coded_found.values())

    def has_codes(self, p: Tensor) -> bool:
        return id(p) in self._codes

    def coded_norms(self, params: list[Tensor], norm_type: float) -> list[Tensor]:
        """The norms of the coded gradients among ``params``, as torch would take them."""
        if norm_type != self.norm_type:
            raise ValueError(
                f"gradients='coded' keeps each gradient's {self.norm_type:g}-norm; a clip with "
                f"norm_type={norm_type:g} needs gradients='held'."
            )
        return [self._codes[id(p)].norm for p in params if id(p) in self._codes]

    def coded_grad(self, p: Tensor) -> Tensor:
        """``p``'s gradient decoded, clipped by the recorded coefficient, in its dtype (a view
        of a buffer kept for the next parameter: the step allocates nothing per parameter);
        the codes are dropped."""
        c = self._codes.pop(id(p))
        coef = None if self.clip_coef is None else self.clip_coef.to(c.codes.device, torch.float32)
        return self._decoded((c.codes, c.scales), c.shape, c.dtype, coef)

    def _decoded(
        self, buf: tuple[Tensor, Tensor], shape: torch.Size, dtype: torch.dtype, coef: Any = None
    ) -> Tensor:
        """The codes ``buf`` of a gradient of ``shape``, decoded (times ``coef``) into the kept
        ``dtype`` buffer, a chunk at a time."""
        codes, scales = buf
        n = shape.numel()
        out = self._grad_buffer.get((codes.device, dtype))
        if out is None or out.numel() < n:
            out = torch.empty(n, dtype=dtype, device=codes.device)
            self._grad_buffer[codes.device, dtype] = out
        scratch = self._scratch_for(codes.device, n)
        if self._c_loop(codes.device):
            from mixprec._core.update.c_loop import decode_grad

            c = None if coef is None else float(coef)
            if decode_grad(codes.view(torch.uint8), scales, c, out[:n]):
                return out[:n].view(shape)
        step = scratch.values.numel()
        for start in range(0, n, step):
            m = min(step, n - start)
            first, last = start // BLOCK, -(-(start + m) // BLOCK)
            part = scratch.values[: (last - first) * BLOCK]
            scratch.decode_(codes[first * BLOCK : last * BLOCK], part)
            part.view(-1, BLOCK).mul_(scales[first:last].unsqueeze(1))
            if coef is not None:
                part.mul_(coef)
            out[start : start + m].copy_(part[:m])
        return out[:n].view(shape)

    def _c_loop(self, device: torch.device) -> bool:
        """Whether codes are made and read by the C loop here: a CPU, the recipe's kernels
        "auto", the default backend (:data:`.spec.CPU_BACKEND`)."""
        from mixprec._core.update import spec

        return device.type == "cpu" and self.fused.kernels != "torch" and spec.CPU_BACKEND == "c"

    def _scratch_for(self, device: torch.device, numel: int) -> Scratch:
        """The :class:`Scratch` for coding and decoding ``numel`` elements on ``device``: a
        :data:`CHUNK` kept on a CPU (whose heap keeps freed holes), the whole gradient at once
        elsewhere (a caching allocator reuses it; fewer kernel launches)."""
        buf = self._chunk_scratch.get(device)
        if device.type != "cpu":  # buffers per gradient; the table kept (a size-0 Scratch)
            buf = self._chunk_scratch[device] = buf or Scratch.on(device, 0)
            return Scratch.on(device, -(-numel // BLOCK) * BLOCK, buf.table)
        if buf is None:
            buf = self._chunk_scratch[device] = Scratch.on(device)
        return buf

    def _drop_codes(self) -> None:
        self._codes.clear()
        self._coded_found.clear()
        self.clip_coef = None
