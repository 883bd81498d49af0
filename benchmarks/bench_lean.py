"""Pure 16-bit training: accuracy, validation loss, peak memory, step time, bytes/param.

    python benchmarks/bench_lean.py                        # MNIST-1D CNN + char-GPT, ~10 min
    python benchmarks/bench_lean.py --cnn-steps 300 --gpt-steps 10   # smoke run
    python benchmarks/bench_lean.py --workloads lsq        # least squares only, ~20 s

Modes: fp32, O2 (fp32 masters), O3 with update="nearest" / "kahan" / "stochastic" (fp32 math on
temporaries, optimizer_states="auto"), and O3 with the old 16-bit-arithmetic step (update=None,
memory rows only).
Training is round-robin: each round gives every mode one step on the same batch, and only that
step is timed, so step-time ratios compare modes that saw the same machine at the same moment
(medians of per-round ratios). Peak memory is measured afterwards in a fresh subprocess per mode
(model + optimizer built inside ``PeakMemory``, two steps), so no mode inherits another's
allocator state; bytes per parameter come from :func:`mixprec.numerics.footprint` in the same
process.

``lsq`` is the small-update regime on its own: least squares on 64 x 16
Gaussian data, SGD lr 2e-3 for 3000 steps from a bf16 Linear(16, 1); it reports the final MSE
(evaluated in fp32 from the 16-bit weights), with the old O3 step (16-bit arithmetic) as an
extra mode.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any

import torch

import mixprec
from mixprec._core.memory import PeakMemory
from mixprec.bench.workloads import WORKLOADS

R, BF16 = mixprec.Recipe, torch.bfloat16
MODES: dict[str, mixprec.Recipe | None] = {
    "fp32": None,
    "O2": R("O2", BF16),
    "O3-nearest": R("O3", BF16, update="nearest"),
    "O3-kahan": R("O3", BF16, update="kahan"),
    "O3-stochastic": R("O3", BF16, update="stochastic"),
}
OLD_O3 = R("O3", BF16, update=None)  # the optimizer's own 16-bit step
MEMORY_ONLY: dict[str, mixprec.Recipe] = {
    "O3 (update=None)": OLD_O3,
    "O3-kahan, bf16 state": R("O3", BF16, update="kahan", optimizer_states=BF16),
    "O3-kahan, kernels=torch": R("O3", BF16, update="kahan", kernels="torch"),
}
WORKLOAD_NAMES = {"cnn": "mnist1d-cnn", "gpt": "char-gpt"}


class Run:
    """One mode of one workload: model, optimizer, batches and a timed step."""

    def __init__(self, wl: Any, data: Any, cfg: mixprec.Recipe | None, batch: int, seed: int):
        self.wl, self.data = wl, data
        torch.manual_seed(seed)
        model = wl.make_model(data)
        opt = wl.make_optimizer(model.parameters())
        if cfg is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, opt = mixprec.initialize(model, opt, cfg)
        self.mixed = cfg is not None
        self.model, self.opt = model, opt
        self.batches = wl.batches(data, batch, seed)

    def step(self) -> tuple[float, float]:
        x, y = next(self.batches)
        t0 = time.perf_counter()
        loss = self.wl.loss(self.model(x), y)
        if self.mixed:
            self.opt.backward(loss)
        else:
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, loss.item()

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        try:
            return float(self.wl.evaluate(self.model, self.data))
        finally:
            self.model.train()


def train(key: str, steps: int, seed: int, log: Any) -> dict[str, dict[str, Any]]:
    wl = WORKLOADS[WORKLOAD_NAMES[key]]
    data = wl.prepare(False, seed)
    runs = {m: Run(wl, data, cfg, wl.batch_size, seed) for m, cfg in MODES.items()}
    times: dict[str, list[float]] = {m: [] for m in runs}
    losses: dict[str, list[float]] = {m: [] for m in runs}
    for i in range(steps):
        for m, r in runs.items():
            dt, loss = r.step()
            times[m].append(dt)
            losses[m].append(loss)
        if (i + 1) % max(1, steps // 10) == 0:
            log(
                f"{key}: step {i + 1}/{steps} "
                + " ".join(f"{m}={statistics.mean(losses[m][-20:]):.3f}" for m in runs)
            )
    out = {}
    for m, r in runs.items():
        ratio = {
            ref: statistics.median(b / a for a, b in zip(times[m][1:], times[ref][1:]))
            for ref in ("fp32", "O2")
        }
        out[m] = {
            "metric": r.evaluate(),
            "median_step": statistics.median(times[m][1:]),
            "speedup_vs_fp32": ratio["fp32"],
            "speedup_vs_O2": ratio["O2"],
            "final_train_loss": statistics.mean(losses[m][-20:]),
            "skipped": getattr(r.opt, "skipped_steps", 0),
        }
    return out


def measure_memory(key: str, mode: str, seed: int) -> dict[str, Any]:
    """Peak of building + two steps, and bytes/param: run in this (fresh) process."""
    wl = WORKLOADS[WORKLOAD_NAMES[key]]
    data = wl.prepare(False, seed)
    cfg = {**MODES, **MEMORY_ONLY}[mode]
    run = None
    with PeakMemory() as pm:
        run = Run(wl, data, cfg, wl.batch_size, seed)
        run.step()
        run.step()
    fp = mixprec.numerics.footprint(run.model, run.opt)
    return {
        "peak_bytes": pm.peak_bytes,
        "bytes": fp.bytes,
        "params": fp.params,
        "bytes_per_param": fp.per_param["total"],
    }


def memory_in_subprocess(key: str, mode: str, seed: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", key, mode, "--seed", str(seed)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def least_squares(steps: int = 3000, lr: float = 2e-3, seed: int = 0) -> dict[str, float]:
    """Final MSE of plain SGD on a bf16 least-squares problem, per mode (fp32 as reference)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 16, generator=g)
    y = x @ (2 * torch.randn(16, 1, generator=g))
    out = {}
    for mode, cfg in {**MODES, "O3 (update=None)": OLD_O3}.items():
        torch.manual_seed(seed)
        model = torch.nn.Linear(16, 1, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        if cfg is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, opt = mixprec.initialize(model, opt, cfg)
        for _ in range(steps):
            loss = (model(x).float() - y).pow(2).mean()
            if cfg is not None:
                opt.backward(loss)
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            out[mode] = float((x @ model.weight.float().t() - y).pow(2).mean())
    return out


def table(key: str, res: dict[str, Any], mem: dict[str, Any]) -> str:
    metric = "test acc" if key == "cnn" else "val loss"
    fp32_peak = mem["fp32"]["peak_bytes"]
    lines = [
        f"| mode | {metric} | peak MiB | vs fp32 | step ms | vs O2 (speed) | bytes/param |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in [*MODES, *MEMORY_ONLY]:
        r, mm = res.get(m), mem[m]
        val = "-" if r is None else (f"{r['metric']:.1%}" if key == "cnn" else f"{r['metric']:.3f}")
        step = "-" if r is None else f"{r['median_step'] * 1e3:.0f}"
        vs_o2 = "-" if r is None else f"{r['speedup_vs_O2']:.2f}x"
        lines.append(
            f"| {m} | {val} | {mm['peak_bytes'] / 2**20:.0f} | "
            f"{mm['peak_bytes'] / fp32_peak:.2f} | {step} | {vs_o2} | "
            f"{mm['bytes_per_param']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cnn-steps", type=int, default=3000)
    p.add_argument("--gpt-steps", type=int, default=120)
    p.add_argument(
        "--workloads", nargs="+", default=["lsq", "cnn", "gpt"], choices=["lsq", "cnn", "gpt"]
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write raw results here")
    p.add_argument("--memory-child", nargs=2, metavar=("WORKLOAD", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_child:
        print(json.dumps(measure_memory(*args.memory_child, args.seed)))
        return
    header = (
        f"{datetime.date.today()} · torch {torch.__version__} · python "
        f"{platform.python_version()} · {torch.get_num_threads()} threads · bf16"
    )
    doc: dict[str, Any] = {"header": header, "command": " ".join(sys.argv)}
    for key in args.workloads:
        t0 = time.perf_counter()
        if key == "lsq":
            doc[key] = least_squares(seed=args.seed)
            print("\nleast squares, SGD lr 2e-3, 3000 steps: final MSE\n")
            print("| mode | MSE |\n|---|---|")
            print("\n".join(f"| {m} | {v:.3g} |" for m, v in doc[key].items()), flush=True)
            continue
        steps = args.cnn_steps if key == "cnn" else args.gpt_steps
        res = train(key, steps, args.seed, lambda s: print(s, flush=True))
        mem = {m: memory_in_subprocess(key, m, args.seed) for m in [*MODES, *MEMORY_ONLY]}
        doc[key] = {
            "steps": steps,
            "train": res,
            "memory": mem,
            "seconds": time.perf_counter() - t0,
        }
        print(f"\n{WORKLOAD_NAMES[key]}, {steps} steps ({doc[key]['seconds']:.0f} s)\n")
        print(table(key, res, mem), flush=True)
    print("\n" + header)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
