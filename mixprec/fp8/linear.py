"""An FP8 ``linear``: output, input gradient and weight gradient through ``torch._scaled_mm``.

Design, per GEMM of ``y = x @ w.T`` (x: M x K tokens, w: N x K; :mod:`.config` has the recipes):

| GEMM | operands | tensorwise scales | rowwise scales (power of 2) |
|---|---|---|---|
| ``y = x w^T`` | x e4m3, w e4m3 | one each | x per row (M, 1), w per row (1, N) |
| ``dx = dy w`` | dy e5m2 / e4m3, w e4m3 | one each | dy per row (M, 1), w per column (1, K) |
| ``dw = dy^T x`` | dy, x | one each | dy per column (N, 1), x per column (1, K) |

**What is saved for backward: the FP8 copy of the input, not the 16-bit input.** torchao
saves the 16-bit ``x`` and casts it again in backward, so its FP8 saves no activation memory.
Here the FP8 ``x`` that the weight-gradient GEMM needs is made in forward and saved (1 byte
per element instead of 2), through :mod:`mixprec.fp8.quantization` -- the storage that
``activations="fp8"`` uses for every other saved tensor, so the rounding and the inf/NaN
handling are the same. Tensorwise, that is the very copy the forward GEMM used. Rowwise, the
weight-gradient GEMM contracts over the tokens (M), so its scales must be constant along M: the
saved copy is ``x`` quantized per *column* (one scale per input feature, over M) from the 16-bit
``x`` in forward -- exactly the operand torchao recomputes in backward, so the numbers are
torchao's while the memory is halved. The rejected alternative, saving the per-row copy and
re-quantizing it per column in backward, rounds twice. The weight is not copied: the layer's
own parameter is saved (it is alive anyway) and cast again in backward. Under FSDP2 with the
weight all-gathered in FP8 (tensorwise) the parameter is a
:class:`~mixprec.fp8.gathered.GatheredFP8Weight`: its bytes and scale are the weight operand of
both GEMMs, with no cast here.

The scales travel as float64 (exactly the float32 values): a saved-tensor hook that narrows
16/32-bit floats (``activations="fp8"``) must not round a scale.

Non-finite values: :func:`mixprec.fp8.quantization.quantize` turns a slice holding inf/NaN into NaN
instead of saturating it to 448, so an overflow reaches the loss or the gradients and the
optimizer skips the step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from mixprec.fp8.config import Scaling
from mixprec.fp8.gathered import GatheredFP8Weight
from mixprec.fp8.gemm import ALIGN, scaled_mm
from mixprec.fp8.quantization import E4M3, Float8Data, quantize_2d

__all__ = ["fp8_linear"]

_LOW = (torch.bfloat16, torch.float16)


def _col_major(t: Tensor) -> Tensor:
    """The same matrix stored column-major (CUDA's layout for the second GEMM operand)."""
    return t.t().contiguous().t()


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    """``t`` with zero rows appended up to ``rows`` (FP8 zeros: they add nothing to a GEMM)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _q(x: Tensor, dtype: torch.dtype, recipe: Scaling, axis: int | None) -> Float8Data:
    return quantize_2d(x, dtype, axis if recipe.rowwise else None, recipe.power_of_2)


def _q_weight(weight: Tensor, recipe: Scaling, axis: int) -> Float8Data:
    """The weight operand: cast here, or as all-gathered in FP8 under FSDP2 (tensorwise: the
    same bytes and scale serve the forward and the input-gradient GEMM)."""
    if isinstance(weight, GatheredFP8Weight):
        if recipe.rowwise:
            raise ValueError(
                "A weight all-gathered in FP8 has one scale; the rowwise recipe scales per row."
            )
        return weight.float8()
    return _q(weight, E4M3, recipe, axis)


def _inv(q: Float8Data) -> Tensor:
    """The dequantization factor ``_scaled_mm`` takes (float32)."""
    return q.scale.reciprocal()


def _weight_grad(
    qdy: Float8Data, x: Tensor, x_inv: Tensor, recipe: Scaling, dtype: torch.dtype
) -> Tensor:
    """``dw = dy^T x``, contracting over the tokens (padded to a multiple of 16 for CUDA).

    On a CPU, where the emulated GEMM's scratch is proportional to its second operand, the
    smaller of ``x`` and ``dy`` goes second (``dw^T = x^T dy`` when ``x`` is wider)."""
    m = -(-qdy.data.shape[0] // ALIGN) * ALIGN
    rowwise = recipe.rowwise
    gemm_dtype = torch.bfloat16 if rowwise else dtype
    dy_inv = _inv(qdy)
    if x.device.type == "cpu" and x.shape[1] > qdy.data.shape[1]:
        dw_t = scaled_mm(
            _pad_rows(x, m).t().contiguous(),
            _col_major(_pad_rows(qdy.data, m)),
            x_inv.reshape(-1, 1) if rowwise else x_inv,
            dy_inv,
            gemm_dtype,
        )
        return dw_t.t().contiguous().to(dtype)
    return scaled_mm(
        _pad_rows(qdy.data, m).t().contiguous(),
        _col_major(_pad_rows(x, m)),
        dy_inv.reshape(-1, 1) if rowwise else dy_inv,
        x_inv,
        gemm_dtype,
    ).to(dtype)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        recipe: Scaling,
        out_dtype: torch.dtype,
    ) -> Tensor:
        n, k = weight.shape
        x2 = x.reshape(-1, k)
        rowwise = recipe.rowwise
        gemm_dtype = torch.bfloat16 if rowwise else out_dtype
        with torch.autocast(x.device.type, enabled=False):
            qx = _q(x2, E4M3, recipe, -1)
            qw = _q_weight(weight, recipe, -1)
            # the bias goes into the GEMM where CUDA allows it (a 16-bit output): one rounding,
            # the same eager and compiled (a separate add lets inductor skip a rounding)
            fused_bias = bias is not None and gemm_dtype in _LOW
            y = scaled_mm(
                qx.data,
                qw.data.t(),
                _inv(qx),
                _inv(qw).reshape(1, -1) if rowwise else _inv(qw),
                gemm_dtype,
                fast_accum=True,  # torchao's default for the output GEMM (Hopper only)
                bias=bias.to(gemm_dtype) if fused_bias else None,
            ).to(out_dtype)
            if bias is not None and not fused_bias:
                y = y + bias.to(out_dtype)
        saved_x = saved_scale = None
        if ctx.needs_input_grad[1]:
            # the weight-gradient GEMM's x: rowwise needs scales constant along M (per column)
            sx = quantize_2d(x2, E4M3, 0, recipe.power_of_2) if rowwise else qx
            saved_x, saved_scale = sx.data, _inv(sx).double()
        ctx.save_for_backward(saved_x, saved_scale, weight)
        ctx.recipe = recipe
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        saved_x, saved_scale, weight = ctx.saved_tensors
        recipe: Scaling = ctx.recipe
        rowwise = recipe.rowwise
        n = weight.shape[0]
        dy2 = dy.reshape(-1, n)
        dx = dw = db = qdy = None
        with _autocast_off(dy.device.type):
            if ctx.needs_input_grad[0]:
                qdy = _q(dy2, recipe.grad_dtype, recipe, -1)
                qw = _q_weight(weight, recipe, 0)  # rowwise: per column, along this GEMM's N
                dx = scaled_mm(
                    qdy.data,
                    _col_major(qw.data),
                    _inv(qdy),
                    _inv(qw),
                    torch.bfloat16 if rowwise else ctx.x_dtype,
                ).to(ctx.x_dtype)
                dx = dx.reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                # rowwise: per column, over M; tensorwise: the copy the dx GEMM used
                qdy_t = _q(dy2, recipe.grad_dtype, recipe, 0) if rowwise or qdy is None else qdy
                dw = _weight_grad(qdy_t, saved_x, saved_scale.float(), recipe, weight.dtype)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                db = dy2.sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None


def _autocast_off(device: str) -> Any:
    """Backward's ops as written, whatever autocast state ``backward()`` was called in. Under
    torch.compile AOTAutograd traces backward outside every autocast region (and runs it with
    autocast disabled), and a region entered inside a traced backward, under an outer
    ``torch.autocast`` region, failed dynamo's global-state check: none there."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.autocast(device, enabled=False)


def fp8_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    recipe: Scaling,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``x @ weight.T + bias`` with its three GEMMs in FP8 (``recipe``); output in
    ``out_dtype`` (default ``x``'s dtype), gradients in ``x``'s and the parameters' dtypes."""
    return _FP8Linear.apply(x, weight, bias, recipe, out_dtype or x.dtype)
