"""Accuracy of coded gradients in nanoGPT's loop: clip by global norm every step, accumulate.

    python benchmarks/bench_coded_parity.py                      # char-gpt, seed 0, its steps
    python benchmarks/bench_coded_parity.py --seeds 0 1 2 --steps 2000 --json out.json
    python benchmarks/bench_coded_parity.py --workload char-gpt-small --seeds 0   # 2,000 steps

The character-level GPT of ``mixprec.bench.workloads`` (4 x 384, context 256, Python's standard
library as the corpus; ``--workload char-gpt-small``: 2 x 128, its 2,000 steps in about an hour
of one core for the four modes), trained as nanoGPT's ``train.py`` trains: ``--micro`` micro-batches
per step, each loss divided by their number and ``loss.backward()``, then
``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` and the step. Modes, taking turns
step by step from the same seed on the same batches: fp32 (torch's AdamW), ``"lean"`` with its
gradients held in 16 bits (what ``"auto"`` does in this loop), ``"lean"`` with
``gradients="coded"``, and the same with 4-bit states. The table gives the final validation
loss per seed, its mean and its difference to fp32.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from typing import Any

import torch
from bench_parity import round_robin

from mixprec.bench.runner import Trainer
from mixprec.bench.workloads import WORKLOADS

MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32": ("fp32", {}),
    "lean, held": ("O3", {"update": "stochastic", "optimizer_states": "8-bit"}),
    "lean, coded": (
        "O3",
        {"update": "stochastic", "optimizer_states": "8-bit", "gradients": "coded"},
    ),
    "lean 4-bit, coded": (
        "O3",
        {"update": "stochastic", "optimizer_states": "4-bit", "gradients": "coded"},
    ),
}


class ClipAccumTrainer(Trainer):
    """A :class:`~mixprec.bench.runner.Trainer` whose step is nanoGPT's: ``micro`` backward
    passes, a global-norm clip at 1.0, the step."""

    micro = 2

    def step(self) -> tuple[float, float]:
        total = 0.0
        for _ in range(self.micro):
            x, y = next(self.batches)
            with self.region():
                loss = self.wl.loss(self.model(x), y) / self.micro
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return 0.0, total


def train(
    seed: int, steps: int, micro: int, log: Any = print, workload: str = "char-gpt"
) -> dict[str, list]:
    wl = WORKLOADS[workload]
    data = wl.prepare(False, seed)
    ClipAccumTrainer.micro = micro
    trainers = {
        m: ClipAccumTrainer(wl, data, mode, torch.bfloat16, wl.batch_size, seed, options)
        for m, (mode, options) in MODES.items()
    }
    return round_robin(wl, trainers, steps, log, f"seed {seed}")


def table(runs: dict[int, dict[str, list]]) -> str:
    seeds = sorted(runs)
    lines = [
        "| mode | final val loss (mean) | per seed | vs fp32 |",
        "|---|---|---|---|",
    ]
    base = statistics.mean(runs[s]["fp32"][-1][1] for s in seeds)
    for m in MODES:
        finals = [runs[s][m][-1][1] for s in seeds]
        mean = statistics.mean(finals)
        vs = "-" if m == "fp32" else f"{mean - base:+.4f}"
        lines.append(f"| {m} | {mean:.4f} | {', '.join(f'{v:.4f}' for v in finals)} | {vs} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=int, default=None, help="default: the workload's own")
    p.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--workload", default="char-gpt", choices=["char-gpt", "char-gpt-small"])
    p.add_argument("--json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or WORKLOADS[args.workload].steps
    runs = {s: train(s, steps, args.micro, workload=args.workload) for s in args.seeds}
    from bench_overhead import machine

    header = (
        f"{datetime.date.today()} · {machine('cpu')} · torch {torch.__version__} · "
        f"{args.workload}, {steps} steps, {args.micro} micro-batches, clip 1.0"
    )
    print(f"\n{header}\n\n{table(runs)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
