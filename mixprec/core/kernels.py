"""Faster 16-bit formulations of ops whose fused kernels are slow on some devices.

Design: the fused CPU flash-attention kernel runs *slower* in bf16 than in fp32 on the CPUs we
measured (see ``benchmarks/NOTES.md``), while two bf16 batched matmuls around a bf16 softmax
are about 2x faster than it, forward plus backward. The softmax stays numerically safe: torch's
16-bit softmax kernels accumulate in float32 internally and only round the result -- exactly the
seed's rule that memory-bound ops keep 16-bit inputs and outputs and compute in fp32 inside.
The engine picks this path only where it was measured faster: CPU, bfloat16, no mask, no
dropout, and training (some input requires grad). Forward alone, the fused kernel is ~2x faster
than the decomposition, so inference keeps it; the decomposition wins on the backward pass.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["can_decompose_attention", "decomposed_attention", "try_decomposed_attention"]

_SDPA_PARAMS = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)

_bias_cache: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}


def _traced(t: torch.Tensor) -> bool:
    """True while a compiler traces ``t`` (fake tensors): cached real tensors must not leak in."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _causal_bias(
    L: int, S: int, dtype: torch.dtype, device: torch.device, cache: bool = True
) -> torch.Tensor:
    key = (L, S, dtype, device)
    bias = _bias_cache.get(key) if cache else None
    if bias is None:
        if len(_bias_cache) > 32:
            _bias_cache.clear()
        keep = torch.ones(L, S, dtype=torch.bool, device=device).tril()
        bias = torch.zeros(L, S, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))
        if cache:
            _bias_cache[key] = bias
    return bias


def can_decompose_attention(
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> bool:
    """True when :func:`decomposed_attention` is both exact in semantics and measured faster."""
    return (
        isinstance(q, torch.Tensor)
        and isinstance(k, torch.Tensor)
        and isinstance(v, torch.Tensor)
        and q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.bfloat16
        and attn_mask is None
        and dropout_p == 0.0
        and not enable_gqa
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
        and q.dim() >= 3
        and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
    )


def try_decomposed_attention(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``F.scaled_dot_product_attention(*args, **kwargs)`` through :func:`decomposed_attention`
    when :func:`can_decompose_attention` says so, else None (run torch's kernel).

    Binds positional *and* keyword arguments by name (``is_causal`` may be positional); the
    eager engine and the graph pass both call this.
    """
    bound = dict(zip(_SDPA_PARAMS, args), **kwargs)
    if not (bound.keys() <= set(_SDPA_PARAMS) and bound.keys() >= set(_SDPA_PARAMS[:3])):
        return None
    q, k, v = (bound[n] for n in _SDPA_PARAMS[:3])
    opts = {n: bound[n] for n in _SDPA_PARAMS[3:] if n in bound}
    if not can_decompose_attention(q, k, v, **opts):
        return None
    return decomposed_attention(
        q, k, v, **{n: opts[n] for n in ("is_causal", "scale") if n in opts}
    )


def decomposed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """``softmax(q @ k^T * scale + causal_bias) @ v`` with 16-bit batched matmuls.

    Same semantics as ``F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=...)``
    (a causal mask is aligned top-left, as in torch).
    """
    *batch, L, E = q.shape
    S, Ev = k.shape[-2], v.shape[-1]
    alpha = scale if scale is not None else 1.0 / math.sqrt(E)
    q3, k3, v3 = q.reshape(-1, L, E), k.reshape(-1, S, E), v.reshape(-1, S, Ev)
    if is_causal:
        bias = _causal_bias(L, S, q.dtype, q.device, cache=not _traced(q))
        bias = bias.expand(q3.shape[0], L, S)
        scores = torch.baddbmm(bias, q3, k3.transpose(1, 2), alpha=alpha)
    else:
        scores = torch.bmm(q3, k3.transpose(1, 2)).mul_(alpha)
    return torch.bmm(scores.softmax(-1), v3).view(*batch, L, Ev)
