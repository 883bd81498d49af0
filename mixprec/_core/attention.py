"""Faster 16-bit formulations of ops whose fused kernels are slow on some devices.

Design: the fused CPU flash-attention kernel runs *slower* in bf16 than in fp32 on the CPUs we
measured (``benchmarks/notes/2026-11-22-first-measurements.md``), while two bf16 batched
matmuls around a bf16 softmax are about 2x faster than it, forward plus backward. The softmax
stays numerically safe: torch's 16-bit softmax kernels accumulate in float32 internally and only
round the result -- exactly the seed's rule that memory-bound ops keep 16-bit inputs and
outputs and compute in fp32 inside.
The engine picks this path only where it was measured faster: CPU, bfloat16, no mask, no
dropout, training (some input requires grad), and at least ``MIN_DECOMPOSED_WORK``
multiply-adds in ``q @ k^T`` (batch x heads x L x S x head size). Forward alone, the fused kernel
is ~2x faster than the decomposition, so inference keeps it; the decomposition wins on the
backward pass, once the matmuls outweigh its extra per-op host cost (about ten more kernel
launches and a Python ``autograd.Function``). The threshold was measured forward + backward,
bf16, causal, eager, both paths taking turns in one process
(``benchmarks/bench_attention_size.py``; AMD EPYC Zen 4 with AVX512_BF16, torch 2.13, 1 and 2
threads; batch x heads 2-96, T 8-256, head size 16 and 64): below 2**21 multiply-adds the
decomposition took 1.04-2.8x the fused kernel's time at 50 of 52 points (0.84x and 0.87x at
the other two), at 2**21 0.71-1.03x, above it 0.40-0.87x.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "MIN_DECOMPOSED_WORK",
    "can_decompose_attention",
    "decomposed_attention",
    "try_decomposed_attention",
]

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

_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU).add(
    torch._C.DispatchKey.AutocastCUDA
)

#: smallest ``q @ k^T`` (batch x heads x L x S x head size) that decomposes; smaller attention
#: is launch-bound and the fused kernel's single call is faster (see the module docstring)
MIN_DECOMPOSED_WORK = 2**21

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
        and q.numel() * k.shape[-2] >= MIN_DECOMPOSED_WORK
    )


def try_decomposed_attention(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``F.scaled_dot_product_attention(*args, **kwargs)`` through :func:`decomposed_attention`
    when :func:`can_decompose_attention` says so, else None (run torch's kernel).

    Binds positional *and* keyword arguments by name (``is_causal`` may be positional); the
    eager engine and the graph pass both call this.
    """
    q = args[0] if args else kwargs.get("query")
    k = args[1] if len(args) > 1 else kwargs.get("key")
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor):
        # the cheap answers first, before binding every argument; the size comes after the
        # static conditions, so a compiled graph guards on it only where it decides
        if q.device.type != "cpu" or q.dtype != torch.bfloat16 or not torch.is_grad_enabled():
            return None
        if k.dim() >= 2 and q.numel() * k.shape[-2] < MIN_DECOMPOSED_WORK:
            return None
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
    (a causal mask is aligned top-left, as in torch). Runs in chunks of the batch-and-heads
    dimension and, for backward, keeps ``q``, ``k`` and ``v`` only, recomputing each chunk's
    probabilities as a fused attention kernel does (see :class:`_Attention`).
    """
    *batch, L, E = q.shape
    S, Ev = k.shape[-2], v.shape[-1]
    alpha = scale if scale is not None else 1.0 / math.sqrt(E)
    q3, k3, v3 = q.reshape(-1, L, E), k.reshape(-1, S, E), v.reshape(-1, S, Ev)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = _Attention.apply(q3, k3, v3, alpha, is_causal)
    else:
        out = torch.cat([_probs(*c, alpha, is_causal).bmm(c[2]) for c in _chunks(q3, k3, v3)])
    return out.view(*batch, L, Ev)


#: elements of one chunk's score matrix (2 MiB in bf16): measured fastest on the GPT benchmark's
#: attention (T 256; 16 of 96 heads a chunk), and it bounds the step's transient memory
_CHUNK_ELEMENTS = 2**20


def _chunks(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Slices along dim 0 (batch x heads) holding about ``_CHUNK_ELEMENTS`` scores each."""
    q3, k3 = tensors[0], tensors[1]
    n = max(1, _CHUNK_ELEMENTS // max(1, q3.shape[1] * k3.shape[1]))
    return list(zip(*(t.split(n) for t in tensors)))


def _probs(
    q3: torch.Tensor, k3: torch.Tensor, v3: Any, alpha: float, is_causal: bool
) -> torch.Tensor:
    """Attention probabilities of one chunk (``v3`` is unused: it keeps call sites uniform)."""
    if is_causal:
        L, S = q3.shape[1], k3.shape[1]
        bias = _causal_bias(L, S, q3.dtype, q3.device, cache=not _traced(q3))
        scores = torch.baddbmm(bias.expand(q3.shape[0], L, S), q3, k3.transpose(1, 2), alpha=alpha)
    else:
        scores = torch.bmm(q3, k3.transpose(1, 2)).mul_(alpha)
    return scores.softmax(-1)


class _Attention(torch.autograd.Function):
    """Decomposed attention that saves its inputs, not its probabilities.

    Keeping the probabilities costs ``batch x heads x L x S`` 16-bit values a layer, more than
    ``q``, ``k`` and ``v`` together once ``L`` exceeds the head size: on the GPT benchmark
    model (T 256, 6 heads of 64) 48 of the 288 MB a bf16 step saved. Backward recomputes each
    chunk's scores and softmax (bitwise the forward's values), then applies the formulas autograd
    uses for ``bmm``, ``baddbmm`` and ``softmax`` in the same order, so gradients are bitwise
    those of the unchunked decomposition. Chunking keeps the transient score matrices small and
    in cache: forward plus backward of that attention layer ran in 48.8 ms against 54.9 ms
    for the decomposition that saved its probabilities (EPYC, 1 thread).
    """

    @staticmethod
    def forward(ctx: Any, q3, k3, v3, alpha: float, is_causal: bool) -> torch.Tensor:
        ctx.save_for_backward(q3, k3, v3)
        ctx.alpha, ctx.is_causal = alpha, is_causal
        return torch.cat([_probs(*c, alpha, is_causal).bmm(c[2]) for c in _chunks(q3, k3, v3)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # The forward ran below torch.autocast (inside a mixprec kernel, or in a graph whose
        # casts are explicit); a backward called inside an autocast region, a mixprec one or
        # another, would lower these matmuls and not the softmax: recompute as the forward did.
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            return _Attention._backward(ctx, grad)

    @staticmethod
    def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
        q3, k3, v3 = ctx.saved_tensors
        alpha, grads = ctx.alpha, []
        for q, k, v, g in _chunks(q3, k3, v3, grad):
            probs = _probs(q, k, v, alpha, ctx.is_causal)
            grad_v = probs.transpose(1, 2).bmm(g)
            grad_scores = torch._softmax_backward_data(
                g.bmm(v.transpose(1, 2)), probs, -1, probs.dtype
            )
            del probs
            if ctx.is_causal:  # baddbmm's backward: (grad @ other^T) * alpha
                grad_q = grad_scores.bmm(k) * alpha
                grad_k = (q.transpose(1, 2).bmm(grad_scores) * alpha).transpose(1, 2)
            else:  # mul_(alpha), then bmm's backward
                grad_scores = grad_scores * alpha
                grad_q = grad_scores.bmm(k)
                grad_k = q.transpose(1, 2).bmm(grad_scores).transpose(1, 2)
            grads.append((grad_q, grad_k, grad_v))
        grad_q, grad_k, grad_v = (torch.cat(g) for g in zip(*grads))
        return grad_q, grad_k, grad_v, None, None
