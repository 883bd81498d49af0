"""PNG of a range audit's log2 histogram, in the style of Micikevicius et al. 2017, Fig. 3.

Kept apart from :mod:`mixprec.numerics.range_audit` because it needs matplotlib (an optional extra):
the audit itself needs torch only, and calls this module, never the other way round. The figure
shows the share of nonzero values per binade ``[2**k, 2**(k+1))``, the fraction of exact zeros in
the title, and for each 16-bit dtype its smallest subnormal, smallest normal and max; with a loss
scale ``S`` a second marker shows where fp16's range sits once gradients are multiplied by ``S``
(the range shifts left by log2 S).
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["plot_histogram"]


def plot_histogram(
    audit: Any,
    path: str,
    kind: str,
    dtypes: Sequence[torch.dtype] = (torch.float16,),
    *,
    exp_min: int,
) -> str:
    """Write the PNG; bin ``i`` of the audit's histograms holds binade ``exp_min + i``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "audit.plot needs matplotlib: pip install 'mixprec[bench]' or pip install matplotlib."
        ) from e
    stats = audit.merged(kind)
    hist = stats.hist.double()
    total = stats.nonzero + stats.zeros
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if stats.nonzero:
        nz = torch.nonzero(hist).flatten()
        lo, hi = int(nz.min()), int(nz.max()) + 1
        xs = [exp_min + i for i in range(lo, hi)]
        ax.bar(
            xs,
            (hist[lo:hi] / stats.nonzero).tolist(),
            width=0.9,
            align="edge",
            color="#4c72b0",
            label=f"{kind}s (nonzero)",
        )
    scale = audit.loss_scale
    colors = {torch.float16: "#c44e52", torch.bfloat16: "#55a868"}
    for dt in dtypes:
        fi = torch.finfo(dt)
        name = str(dt).replace("torch.", "")
        sub = math.log2(fi.smallest_normal * fi.eps)
        c = colors.get(dt, "k")
        ax.axvline(sub, color=c, ls="-", lw=1.5, label=f"{name} smallest subnormal 2^{sub:.0f}")
        ax.axvline(
            math.log2(fi.smallest_normal), color=c, ls="--", lw=1, label=f"{name} smallest normal"
        )
        ax.axvline(math.log2(fi.max), color=c, ls=":", lw=1.5, label=f"{name} max")
        if kind == "gradient" and scale != 1.0 and dt == torch.float16:
            ax.axvline(
                sub - math.log2(scale),
                color=c,
                ls="-",
                lw=3,
                alpha=0.35,
                label=f"{name} smallest subnormal after loss scale {scale:g}",
            )
        if kind == "gradient" and dt == torch.float16:
            f = stats.fractions("fp16")
            ax.text(
                0.01,
                0.95,
                f"{f['underflow']:.1%} of nonzero values underflow to 0 in "
                f"{name} at scale {scale:g}; {f['overflow']:.2%} overflow",
                transform=ax.transAxes,
                va="top",
                fontsize=9,
            )
    zero = stats.zeros / total if total else 0.0
    ax.set_title(f"log2 |{kind}| over the audited modules ({zero:.0%} of values are zero)")
    ax.set_xlabel("log2 |value| (binade)")
    ax.set_ylabel("fraction of nonzero values")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return str(out)
