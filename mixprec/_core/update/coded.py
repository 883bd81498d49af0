"""Gradients coded in 8 bits as they complete (``Recipe(gradients="coded")``, and "auto" where
the loop clips or accumulates): a byte per parameter where clipping and accumulation work.

Each 16-bit gradient, in its post-accumulate-grad hook, is checked for inf/NaN, its norm taken
from the 16-bit values as ``clip_grad_norm_`` takes it, coded as FP8 E4M3 with a float32 scale
per 256 elements (at most 2**-4 relative error; a second gradient adds into the codes,
stochastically rounded) and freed; a clip records its coefficient and the step decodes, clips
and steps one parameter at a time. Design and numerics:
``docs/design.md``, "Optimizer states in fewer bits", its subsection on gradients as codes.
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


class CodedGradient(NamedTuple):
    """One parameter's gradient as FP8 E4M3 codes with a float32 scale per :data:`BLOCK`."""

    codes: Tensor
    scales: Tensor
    shape: torch.Size
    dtype: torch.dtype
    norm: Tensor

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


class Scratch:
    """Buffers kept for coding and decoding on one device: a float32 chunk, its int32 code
    indices, E4M3's 256 values (a table: the dtype's own conversion is 5x slower on a CPU) and,
    once an accumulation needs it, a float32 chunk of noise for its stochastic rounding."""

    __slots__ = ("index", "noise", "table", "values")

    def __init__(self, values: Tensor, index: Tensor, table: Tensor):
        self.values, self.index, self.table = values, index, table
        self.noise: Tensor | None = None

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

    def noise_for(self, y: Tensor) -> Tensor:
        """The noise buffer, as ``y`` (a chunk of :attr:`values`), made on first use."""
        if self.noise is None:
            self.noise = torch.empty_like(self.values)
        return self.noise[: y.numel()].view_as(y)

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
    ``add``, ``g`` plus what ``out`` holds; with ``generator``, stochastically rounded.
    ``c_loop``: in one C pass on a CPU where it can (the torch ops' arithmetic, nearest, not
    added), which also says whether every value was finite (None where the torch ops ran)."""
    flat = g.detach().reshape(-1)
    if c_loop and not add and generator is None:
        from mixprec._core.update.c_loop import code_grad

        finite = code_grad(flat, out[0].view(torch.uint8), out[1])
        if finite is not None:
            return finite
    n = flat.numel()
    _code_chunks(flat, out, generator, add, scratch or Scratch.on(g.device, _rounded(n)))
    return None


def _rounded(n: int) -> int:
    """``n`` elements in whole blocks, at most a :data:`CHUNK`."""
    return min(CHUNK, -(-n // BLOCK) * BLOCK)


def _code_chunks(
    flat: Tensor, out: tuple[Tensor, Tensor], generator: Any, add: bool, scratch: Scratch
) -> None:
    """:func:`code` with torch's ops, a chunk of ``scratch`` at a time, in place."""
    codes, scales = out
    n, step = flat.numel(), scratch.values.numel()  # a multiple of BLOCK
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
        if generator is not None:  # the code indices' buffer is free once decoded
            unit = scratch.index[: y.numel()].view(torch.float32).view_as(y)
            _dither_(y, generator, unit, scratch.noise_for(y))
        c.view(-1, BLOCK).copy_(y)


def _dither_(y: Tensor, generator: torch.Generator, step: Tensor, noise: Tensor) -> None:
    """Add uniform noise of one E4M3 code step at each value (2**(exponent - 3); the subnormal
    step below 2**-6): rounding to nearest after it rounds stochastically. ``step`` and
    ``noise``: buffers of ``y``'s size (nothing chunk-sized is made in backward)."""
    torch.abs(y, out=step).clamp_(min=2.0**-6).log2_().floor_().sub_(_MANTISSA).exp2_()
    torch.rand(y.shape, generator=generator, device=y.device, out=noise)
    y.addcmul_(noise.sub_(0.5), step).clamp_(-_E4M3_MAX, _E4M3_MAX)


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
    gradients: str
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

    @torch.no_grad()
    def _code_grad(self, p: Tensor) -> None:
        """The post-accumulate-grad hook: code ``p``'s fresh gradient (added to its codes in
        an accumulation: the fp32 sum, stochastically rounded; its norm the sum's) and free it."""
        g = p.grad
        if g.is_sparse:
            raise RuntimeError("gradients='coded' needs dense gradients; use gradients='held'.")
        buf, norm = self._buffers_for(p, g)
        if id(p) not in self._codes:
            torch_norm(g, 2.0, norm)
            finite = code(g, buf, scratch=self._scratch_for(g), c_loop=self._c_loop(g.device))
        else:
            finite = None
            code(g, buf, self._generator(p, g.device), True, self._scratch_for(g))
            torch_norm(self._decoded(buf, p.shape, g.dtype), 2.0, norm)
        self._check(g, finite)
        self._codes[id(p)] = CodedGradient(*buf, p.shape, g.dtype, norm)
        p.grad = None

    def _check(self, g: Tensor, finite: bool | None) -> None:
        """Record whether ``g`` holds an inf/NaN (``finite``: known from the C pass that coded
        it): on a CPU the C loop's pass (no temporary), elsewhere a flag on the device."""
        flag = self._coded_found.get(g.device)
        if flag is None:
            flag = self._coded_found[g.device] = torch.zeros((), device=g.device)
        if g.device.type != "cpu":
            flag.add_((~torch.isfinite(g)).any())
        elif not (self.fused.finite(g) if finite is None else finite):
            flag.fill_(1.0)

    def _buffers_for(self, p: Tensor, g: Tensor) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """``p``'s codes and its norm's 0-d tensor, kept from step to step (a small tensor
        made in backward between autograd's gradients pins their freed blocks)."""
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

    def coded_norm(self, p: Tensor) -> Tensor:
        """The 2-norm of ``p``'s coded gradient, as torch would take it (another clip is
        refused or decoded first: :meth:`.release.ReleasedGradients._clip_refusal`)."""
        return self._codes[id(p)].norm

    def coded_grad(self, p: Tensor) -> Tensor:
        """``p``'s gradient decoded, clipped by the recorded coefficient, in its dtype (a view
        of a buffer kept for the next parameter: the step allocates nothing per parameter);
        the codes are dropped."""
        c = self._codes.pop(id(p))
        if self.gradients != "coded":  # "auto" released them after this first step: freed as used
            self._code_buffers.pop(id(p), None)
        coef = None if self.clip_coef is None else self.clip_coef.to(c.codes.device, torch.float32)
        return self._decoded((c.codes, c.scales), c.shape, c.dtype, coef)

    def _decoded(
        self, buf: tuple[Tensor, Tensor], shape: torch.Size, dtype: torch.dtype, coef: Any = None
    ) -> Tensor:
        """The codes ``buf`` of a gradient of ``shape``, decoded (times ``coef``) into the kept
        ``dtype`` buffer: in one C pass on a CPU, else a chunk at a time."""
        codes, scales = buf
        n = shape.numel()
        out = self._grad_buffer.get((codes.device, dtype))
        if out is None or out.numel() < n:
            out = self._grad_buffer[codes.device, dtype] = codes.new_empty(n, dtype=dtype)
        if self._c_loop(codes.device):
            from mixprec._core.update.c_loop import decode_grad

            c = None if coef is None else float(coef)
            if decode_grad(codes.view(torch.uint8), scales, c, out[:n]):
                return out[:n].view(shape)
        return self._decode_chunks(codes, scales, coef, out[:n]).view(shape)

    def _decode_chunks(self, codes: Tensor, scales: Tensor, coef: Any, out: Tensor) -> Tensor:
        """:meth:`_decoded` with torch's ops, through the scratch, into ``out``."""
        n = out.numel()
        scratch = self._scratch_for(out)
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
        return out

    def _c_loop(self, device: torch.device) -> bool:
        """Whether codes are made and read by the C loop here: a CPU, the recipe's kernels
        "auto", the default backend (:data:`.spec.CPU_BACKEND`)."""
        from mixprec._core.update import spec

        return device.type == "cpu" and self.fused.kernels != "torch" and spec.CPU_BACKEND == "c"

    def _scratch_for(self, g: Tensor) -> Scratch:
        """The :class:`Scratch` for coding or decoding ``g``: at most a :data:`CHUNK`, kept, on
        a CPU (whose heap keeps freed holes), the whole gradient at once elsewhere (a caching
        allocator reuses it; fewer kernel launches)."""
        device, numel = g.device, g.numel()
        buf = self._chunk_scratch.get(device)
        if device.type != "cpu":  # buffers per gradient; the table kept (a size-0 Scratch)
            buf = self._chunk_scratch[device] = buf or Scratch.on(device, 0)
            return Scratch.on(device, -(-numel // BLOCK) * BLOCK, buf.table)
        need = _rounded(numel)
        if buf is None or buf.values.numel() < need:  # grown to the largest gradient's chunk
            table = None if buf is None else buf.table
            buf = self._chunk_scratch[device] = Scratch.on(device, need, table)
        return buf

    def _drop_codes(self) -> None:
        """The step's codes gone; the buffers too where gradients are no longer coded."""
        self._codes.clear()
        self._coded_found.clear()
        self.clip_coef = None
        if self.gradients != "coded":
            self._code_buffers.clear()
            self._chunk_scratch.clear()
            self._grad_buffer.clear()
