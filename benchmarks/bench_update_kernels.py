"""The update kernels alone: milliseconds per million elements and the bandwidth they reach.

    OMP_NUM_THREADS=1 python benchmarks/bench_update_kernels.py [--size 1] [--inductor]

One AdamW step of a ``--size`` million-element bf16 weight (a 1024-column matrix), timed
kernel by kernel in one process, rounds interleaved (median of ``--rounds``): torch's fused
fp32 AdamW (``torch._fused_adamw_``, what ``AdamW(fused=True)`` runs) on fp32 weight, gradient
and states; then mixprec's C loops (:mod:`mixprec._core.update.c_loop`) for each kind of
update step a recipe makes: O3's Kahan update (bf16 weight and compensation, bf16 ``exp_avg``,
fp32 ``exp_avg_sq``), stochastic rounding with the same states, ``"lean"`` (stochastic rounding,
8-bit states) and ``"lean"`` with 4-bit states; with ``--inductor``, the same steps compiled by
:func:`torch.compile` (inductor's C++; the first call compiles, not timed). "bytes" is the
least an update must read and write per element; "GB/s" is those bytes over the step's time,
and "x copy" that rate over a large fp32 copy timed in the same rounds (read + write). At 1 M
elements the fp32 AdamW's 28 MB fit in a large L3, the copy's 512 MB do not: ``--size 16``
leaves every kernel in DRAM.

``--floor`` adds a C loop of the same build flags that does only the exact arithmetic every
Adam step must do per element, whatever its storage: one square root and two divisions (``m /
(sqrt(v) / sqrt(bc2) + eps)``, reading two fp32 arrays and writing one). Its time is a floor for
any exact Adam update on this core, however few bytes the update moves.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from bench_overhead import machine

from mixprec._core.update import c_loop, compiled_step, spec
from mixprec._core.update.spec import Held, StepKind
from mixprec._core.update.state_codes import QuantizedState

BF16 = torch.bfloat16
#: kind -> (compile key, least bytes per element: reads + writes)
F32 = torch.float32
_S8 = (Held(fmt="8-bit", kind="signed"), Held(fmt="8-bit", kind="sqrt"))
_S4 = (Held(fmt="4-bit", kind="signed"), Held(fmt="4-bit", kind="sqrt"))
_PLAIN = (Held(dtype=BF16), Held(dtype=F32))


def _kind(update: str, states: tuple) -> StepKind:
    return StepKind("adam", update, BF16, BF16, states, decoupled=True)


KINDS = {
    "O3 Kahan": (_kind("kahan", _PLAIN), 2 + 2 + 2 + 2 + 4 + 10),
    "stochastic": (_kind("stochastic", _PLAIN), 2 + 2 + 2 + 4 + 8),
    "lean (8-bit)": (_kind("stochastic", _S8), 2 + 2 + 1 + 1 + 2 + 1 + 1),
    "lean 4-bit": (_kind("stochastic", _S4), 2 + 2 + 1 + 2 + 1),
}
#: AdamW lr 1e-3, betas (0.9, 0.999), wd 0.01 at step 10
GROUP = {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.01, "eps": 1e-8}


def operands(key: StepKind, rows: int, cols: int) -> tuple:
    """(weight, compensation or None, gradient, [states as the kernel takes them])."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(rows, cols, generator=g).to(BF16)
    grad = (torch.randn(rows, cols, generator=g) * 1e-3).to(BF16)
    comp = torch.zeros_like(w) if key.update == "kahan" else None
    states = []
    for held in key.states:
        x = torch.rand(rows, cols, generator=g) * (1e-3 if held.kind != "sqrt" else 1e-6)
        if held.fmt is not None:
            q = QuantizedState.quantize(x, held.fmt, held.kind)
            states.append((q.codes, q.scale))
        else:
            states.append(x.to(held.dtype))
    return w, comp, grad, states


def _scalars(key: StepKind) -> torch.Tensor:
    return torch.tensor(spec.scalars(key, GROUP, {"step": 9.0}))


def c_step(key: StepKind, rows: int, cols: int):
    w, comp, grad, states = operands(key, rows, cols)
    c_loop.kernel(key)  # built before the clock starts
    sc = _scalars(key)
    return lambda: c_loop.run(key, (w, comp, grad), states, sc, 12345, 678)


def inductor_step(key: StepKind, rows: int, cols: int):
    w, comp, grad, states = operands(key, rows, cols)
    view = (rows, cols) if key.coded else (-1,)
    states = [s if isinstance(s, tuple) else s.view(view) for s in states]
    fn = torch.compile(compiled_step.build(key), dynamic=True, fullgraph=True,
                       options=compiled_step.OPTIONS)  # fmt: skip
    base, mix, sc = torch.tensor(12345), torch.tensor(678), _scalars(key)
    args = (w.view(view), None if comp is None else comp.view(view), grad.view(view), *states)
    fn(*args, sc, base, mix)  # the compile
    return lambda: fn(*args, sc, base, mix)


def torch_step(n: int):
    g = torch.Generator().manual_seed(0)
    p, grad, m = (torch.randn(n, generator=g) for _ in range(3))
    v, step = torch.rand(n, generator=g), torch.tensor(10.0)
    return lambda: torch._fused_adamw_([p], [grad], [m], [v], [], [step], lr=1e-3, beta1=0.9,
                                       beta2=0.999, weight_decay=0.01, eps=1e-8,
                                       amsgrad=False, maximize=False)  # fmt: skip


FLOOR_C = """
#include <math.h>
#include <stdint.h>
void floor_step(int64_t n, const float *m, const float *v, float *out, float bc2, float eps) {
    for (int64_t i = 0; i < n; i++) out[i] = m[i] / (sqrtf(v[i]) / bc2 + eps);
}
"""


def floor_step(n: int):
    """The exact sqrt + two divisions per element alone, built as the update kernels are."""
    folder = Path(tempfile.mkdtemp(prefix="mixprec-floor-"))
    (folder / "floor.c").write_text(FLOOR_C)
    flags = [f for f in c_loop._FLAGS if f != "-fopenmp"]
    cmd = [c_loop._compiler(), *flags, str(folder / "floor.c"), "-o", str(folder / "f.so")]
    subprocess.run([*cmd, "-lm"], check=True)
    fn = ctypes.CDLL(str(folder / "f.so")).floor_step
    fn.argtypes = [ctypes.c_int64, *(ctypes.c_void_p,) * 3, ctypes.c_float, ctypes.c_float]
    g = torch.Generator().manual_seed(0)
    m, v = torch.randn(n, generator=g), torch.rand(n, generator=g)
    out = torch.empty(n)
    return lambda: fn(n, m.data_ptr(), v.data_ptr(), out.data_ptr(), 0.999**0.5, 1e-8)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=float, default=1.0, help="million elements per step")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--inductor", action="store_true", help="also time torch.compile's steps")
    p.add_argument("--floor", action="store_true", help="also time sqrt + 2 divisions alone")
    args = p.parse_args(argv)
    cols = 1024
    rows = max(1, round(args.size * 2**20 / cols))
    n = rows * cols
    steps = {"torch fused AdamW, fp32": (torch_step(n), 28)}
    for name, (key, nbytes) in KINDS.items():
        steps[f"C loop: {name}"] = (c_step(key, rows, cols), nbytes)
        if args.inductor:
            steps[f"inductor: {name}"] = (inductor_step(key, rows, cols), nbytes)
    if args.floor:  # bytes: the two fp32 inputs and the output
        steps["floor: sqrt + 2 divisions (exact)"] = (floor_step(n), 12)
    src = torch.randn(2**27)
    dst = torch.empty_like(src)
    times: dict[str, list[float]] = {k: [] for k in [*steps, "copy"]}
    for _ in range(args.rounds + 2):
        for name, (fn, _) in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(src)
        times["copy"].append(time.perf_counter() - t0)
    copy_rate = 2 * src.nbytes / statistics.median(times["copy"][2:])
    print(f"{machine('cpu')}, torch {torch.__version__}")
    print(f"{n / 1e6:.2f} M elements per step, {args.rounds} rounds; fp32 copy "
          f"{copy_rate / 1e9:.1f} GB/s (read + write)\n")  # fmt: skip
    print("| kernel | bytes / element | ms per M elements | GB/s | x copy |")
    print("|---|---|---|---|---|")
    for name, (_, nbytes) in steps.items():
        t = statistics.median(times[name][2:])
        rate = nbytes * n / t
        print(f"| {name} | {nbytes} | {t * 1e3 / (n / 2**20):.2f} | {rate / 1e9:.1f} | "
              f"{rate / copy_rate:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
