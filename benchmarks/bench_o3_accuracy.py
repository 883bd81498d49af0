"""Does O3 in bf16 keep fp32's accuracy with its default update? MNIST-1D CNN, several seeds.

    python benchmarks/bench_o3_accuracy.py                      # 6000 steps x 3 seeds
    python benchmarks/bench_o3_accuracy.py --steps 300 --seeds 0 --quick   # smoke run
    python benchmarks/bench_o3_accuracy.py --render benchmarks/results_o3_accuracy.json

The MNIST-1D paper's CNN (:class:`mixprec.bench.workloads.MNIST1DCNN`, 5,210 parameters) on the
standard MNIST-1D set generated locally (4000 train / 1000 test, data seed 42), Adam lr 1e-2,
batch 100. Every mode of one seed starts from the same fp32 initialisation (``torch.manual_seed``)
and sees the same batches: training is round-robin, one step of every mode on each batch, so the
modes also share the machine's state moment by moment. Only the step is timed (forward, backward,
optimizer step, ``zero_grad``). The table's "step ms" is the median over seeds of each seed's
median step, and "vs fp32" is the ratio of those shown medians (above 1 is slower); the JSON
also keeps each seed's median of per-round ratios (``time_vs_fp32``).

Modes: fp32; O2 bf16 (fp32 masters); O3 bf16 with ``initialize``'s default update (whatever it
resolves to, recorded in the output: ``"kahan"``); O3 bf16 with ``update=None`` (the optimizer's
own bf16 arithmetic, the default before) and ``"stochastic"``; ``--modes`` adds an explicit
``"O3 bf16 kahan"``. Bytes per parameter come from :func:`mixprec.numerics.footprint` after
training (optimizer state, compensation, masters, and the total with weights and gradients).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import sys
import time
import warnings
from typing import Any

import torch

import mixprec
from mixprec.bench.workloads import (
    MNIST1DCNN,
    cross_entropy,
    load_mnist1d,
    mnist1d_accuracy,
    mnist1d_batches,
)

R = mixprec.Recipe
MODES: dict[str, mixprec.Recipe | None] = {
    "fp32": None,
    "O2 bf16": R("O2", torch.bfloat16),
    "O3 bf16 default": R("O3", torch.bfloat16),  # update="auto": the level's default
    "O3 bf16 update=None": R("O3", torch.bfloat16, update=None),
    "O3 bf16 kahan": R("O3", torch.bfloat16, update="kahan"),
    "O3 bf16 stochastic": R("O3", torch.bfloat16, update="stochastic"),
}
# "O3 bf16 kahan" is the bf16 default, measured as "O3 bf16 default" (its update column says so)
DEFAULT_RUN = [m for m in MODES if m != "O3 bf16 kahan"]
HERE = pathlib.Path(__file__).resolve().parent


class Run:
    """One mode of one seed: model, optimizer and a timed training step."""

    def __init__(self, recipe: mixprec.Recipe | None, seed: int, lr: float):
        torch.manual_seed(seed)
        model: Any = MNIST1DCNN()
        opt: Any = torch.optim.Adam(model.parameters(), lr=lr)
        self.mixed = recipe is not None
        if recipe is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "bf16 is slow on this CPU": known, measured
                model, opt = mixprec.initialize(model, opt, recipe)
        self.model, self.opt = model, opt
        updater = getattr(opt, "updater", None)
        self.update = None if updater is None else updater.update

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = cross_entropy(self.model(x), y)
        if self.mixed:
            self.opt.backward(loss)
        else:
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, loss.item()

    def accuracy(self, data: dict[str, torch.Tensor]) -> float:
        self.model.eval()
        try:
            return mnist1d_accuracy(self.model, data)
        finally:
            self.model.train()


def train_seed(
    data: dict[str, torch.Tensor],
    modes: list[str],
    seed: int,
    steps: int,
    batch: int,
    lr: float,
    eval_every: int,
) -> dict[str, Any]:
    runs = {m: Run(MODES[m], seed, lr) for m in modes}
    times: dict[str, list[float]] = {m: [] for m in modes}
    losses: dict[str, list[float]] = {m: [] for m in modes}
    curve: dict[str, list[tuple[int, float]]] = {m: [] for m in modes}
    batches = mnist1d_batches(data, batch, seed)
    t_start = time.perf_counter()
    for i in range(steps):
        x, y = next(batches)
        for m, r in runs.items():
            dt, loss = r.step(x, y)
            times[m].append(dt)
            losses[m].append(loss)
        if (i + 1) % eval_every == 0 or i + 1 == steps:
            for m, r in runs.items():
                curve[m].append((i + 1, r.accuracy(data)))
            print(
                f"seed {seed} step {i + 1}/{steps} ({time.perf_counter() - t_start:.0f} s): "
                + "  ".join(f"{m} {curve[m][-1][1]:.1%}" for m in modes),
                flush=True,
            )
    out: dict[str, Any] = {}
    for m, r in runs.items():
        per_param = mixprec.numerics.footprint(r.model, r.opt).per_param
        ratio = (
            statistics.median(a / b for a, b in zip(times[m][1:], times["fp32"][1:]))
            if "fp32" in times and len(times[m]) > 1
            else None
        )
        out[m] = {
            "update": r.update,
            "test_accuracy": curve[m][-1][1],
            "curve": curve[m],
            "final_train_loss": statistics.mean(losses[m][-100:]),
            "median_step_s": statistics.median(times[m][1:] or times[m]),
            "time_vs_fp32": ratio,
            "bytes_per_param": per_param,
            "skipped_steps": getattr(r.opt, "skipped_steps", 0),
        }
    return out


def machine() -> dict[str, Any]:
    report = mixprec.check("cpu", verbose=False)
    return {
        "cpu": report.name,
        "bf16": report.dtypes["bfloat16"].reason,
        "features": list(report.features),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def summarize(doc: dict[str, Any]) -> str:
    seeds = doc["seeds"]
    per_seed = doc["results"]
    fp32 = [per_seed[str(s)]["fp32"]["test_accuracy"] for s in seeds]

    def step_ms(mode: str) -> float:
        return 1e3 * statistics.median(per_seed[str(s)][mode]["median_step_s"] for s in seeds)

    head = " | ".join(f"seed {s}" for s in seeds)
    lines = [
        f"| mode | update | {head} | mean | vs fp32 (points) | step ms | vs fp32 | "
        "B/param: optimizer state | masters | compensation | total |",
        "|---|---|" + "---|" * len(seeds) + "---|---|---|---|---|---|---|---|",
    ]
    for m in doc["modes"]:
        rows = [per_seed[str(s)][m] for s in seeds]
        accs = [r["test_accuracy"] for r in rows]
        mean = statistics.mean(accs)
        bpp = rows[-1]["bytes_per_param"]
        update = rows[0]["update"] if MODES[m] and MODES[m].level == "O3" else "-"
        ms = step_ms(m)
        lines.append(
            f"| {m} | {update} | "
            + " | ".join(f"{a:.1%}" for a in accs)
            + f" | {mean:.2%} | {100 * (mean - statistics.mean(fp32)):+.2f} | "
            + f"{ms:.3g} | {ms / step_ms('fp32'):.2f}x"
            + f" | {bpp['optimizer_state']:.1f} | {bpp['masters']:.1f}"
            f" | {bpp['compensation']:.1f} | {bpp['total']:.1f} |"
        )
    return "\n".join(lines)


def header(doc: dict[str, Any]) -> str:
    info = doc["machine"]
    return (
        f"{doc['workload']}; {len(doc['seeds'])} seeds; {doc['seconds']:.0f} s\n"
        f"{info['cpu']} ({info['bf16']}), {info['threads']} threads, torch {info['torch']}, "
        f"python {info['python']}, {doc['date']}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--quick", action="store_true", help="the 1000/250 MNIST-1D set (smoke runs)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own)")
    p.add_argument("--render", metavar="JSON", help="print the table of a saved run and exit")
    p.add_argument("--modes", nargs="+", default=DEFAULT_RUN, choices=list(MODES))
    p.add_argument("--json", default=str(HERE / "results_o3_accuracy.json"))
    args = p.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            doc = json.load(f)
        print(f"{header(doc)}\n\n{summarize(doc)}")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = ["fp32", *[m for m in args.modes if m != "fp32"]]  # the reference always runs
    t0 = time.perf_counter()
    data = load_mnist1d(num_samples=1250 if args.quick else None)
    doc: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine(),
        "workload": f"MNIST-1D ({len(data['x'])}/{len(data['x_test'])}, data seed 42), "
        f"MNIST1DCNN, Adam lr {args.lr}, batch {args.batch}, {args.steps} steps",
        "steps": args.steps,
        "seeds": args.seeds,
        "modes": modes,
        "results": {},
    }
    for seed in args.seeds:
        doc["results"][str(seed)] = train_seed(
            data, modes, seed, args.steps, args.batch, args.lr, args.eval_every
        )
    doc["seconds"] = time.perf_counter() - t0
    doc["table"] = summarize(doc)
    print(f"\n{header(doc)}\n\n{doc['table']}", flush=True)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
