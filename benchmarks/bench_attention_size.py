"""Where mixprec's decomposed CPU attention starts to beat torch's fused kernel: a size sweep.

    OMP_NUM_THREADS=1 python benchmarks/bench_attention_size.py
    python benchmarks/bench_attention_size.py --threads 2 --rounds 7

Forward plus backward of one causal bf16 attention call, eager, at each (batch x heads, T, head
size): torch's ``F.scaled_dot_product_attention`` and
``mixprec._core.attention.decomposed_attention`` take turns in every round; the ratio is the
median of the per-round ratios (below 1: the decomposition is faster). "work" counts the
multiply-adds of ``q @ k^T``, the size that ``attention.MIN_DECOMPOSED_WORK`` is compared with.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mixprec._core import attention


def _time(fn: Callable, q: torch.Tensor, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn(q, q, q, is_causal=True).sum().backward()
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--heads", nargs="+", type=int, default=[2, 8, 32, 96], help="batch x heads")
    p.add_argument("--lengths", nargs="+", type=int, default=[8, 16, 32, 64, 128, 256])
    p.add_argument("--head-sizes", nargs="+", type=int, default=[16, 64])
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"threshold {attention.MIN_DECOMPOSED_WORK} multiply-adds\n"
    )
    print("| batch x heads | T | head size | work | fused (us) | decomposed (us) | ratio |")
    print("|---|---|---|---|---|---|---|")
    for bh in args.heads:
        for T in args.lengths:
            for E in args.head_sizes:
                g = torch.Generator().manual_seed(0)
                q = torch.randn(bh, T, E, generator=g).bfloat16().requires_grad_()
                work = bh * T * T * E
                n = max(1, min(200, 2 * 10**7 // work))
                fused, ours = [], []
                for r in range(args.rounds + 1):  # round 0 warms up
                    a = _time(F.scaled_dot_product_attention, q, n)
                    b = _time(attention.decomposed_attention, q, n)
                    if r:
                        fused.append(a)
                        ours.append(b)
                ratio = statistics.median(b / a for a, b in zip(fused, ours))
                print(
                    f"| {bh} | {T} | {E} | {work} | {statistics.median(fused) * 1e6:.0f} | "
                    f"{statistics.median(ours) * 1e6:.0f} | {ratio:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
