"""Accuracy parity: every precision mode trained to the end on real data, against fp32.

    python benchmarks/bench_parity.py                          # both workloads, all modes
    python benchmarks/bench_parity.py --workloads mnist1d-cnn --seeds 0 1 2
    python benchmarks/bench_parity.py --json docs/bench/parity.json

Workloads (``mixprec.bench.workloads``): the MNIST-1D paper's CNN on MNIST-1D (generated
locally, accuracy on its test split) and the character-level GPT (4x384, context 256) on a
corpus built from Python's own standard library (validation loss). Each mode trains the same
model from the same seed on the same batches, for the workload's full step count; the modes
take turns step by step, so they also see the same machine.

Per mode and workload the table gives the final metric (mean over seeds), its difference to
fp32, the steps to the workload's target (first evaluation that reaches it; mean over the seeds
that did) and the skipped steps. Modes: fp32, torch.autocast bf16, mixprec O1/O2/O3 bf16 and O3
with FP8 activations (``ActivationConfig("fp8", min_numel=1024)``: the CNN's saved tensors are
all below the default 65536 elements); with ``--modes``, also ``lean`` (O3, stochastic rounding,
8-bit optimizer states), ``lean`` with 4-bit states, O3 with 8-bit states and ``lean, fp32
compute`` (storage-only precision: lean's storage, the forward and backward in fp32, each layer's
weights widened for its own use; ``Recipe("lean", dtype, compute="fp32")``; ``--code-all-states``
codes the states of tensors below 4096 elements too: all of the CNN's are); ``--dtype fp16`` runs
them in fp16 (torch.autocast with a GradScaler), which on a CPU without AVX512_FP16 is about 100x
slower.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
from typing import Any

import torch

from mixprec import ActivationConfig
from mixprec.bench.runner import Trainer
from mixprec.bench.workloads import WORKLOADS

MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32": ("fp32", {}),
    "torch.autocast": ("torch-autocast", {}),
    "O1": ("O1", {}),
    "O2": ("O2", {}),
    "O3": ("O3", {}),
    # min_numel 1024 instead of 65536: the CNN's saved tensors are all smaller than the default
    "O3, activations=fp8": ("O3", {"activations": ActivationConfig("fp8", min_numel=1024)}),
    # the training state in fewer bytes: 8-bit states with stochastic rounding (the "lean"
    # recipe, written out: it equals Recipe("lean", dtype)), 4-bit states, and 8-bit states
    # under the Kahan update
    "lean": ("O3", {"update": "stochastic", "optimizer_states": "8-bit", "gradients": "auto"}),
    "lean, 4-bit states": (
        "O3",
        {"update": "stochastic", "optimizer_states": "4-bit", "gradients": "auto"},
    ),
    "O3, 8-bit states": ("O3", {"update": "kahan", "optimizer_states": "8-bit"}),
    # storage-only precision: lean's storage (bf16 weights, 8-bit states, stochastic rounding)
    # with the forward and backward in fp32, each layer's weights widened for its own use;
    # it equals Recipe("lean", dtype, compute="fp32")
    "lean, fp32 compute": (
        "O3",
        {
            "update": "stochastic",
            "optimizer_states": "8-bit",
            "gradients": "auto",
            "compute": "fp32",
        },
    ),
}
DEFAULT_MODES = list(MODES)[:6]


def round_robin(wl: Any, trainers: dict[str, Any], steps: int, log: Any, label: str) -> dict:
    """``steps`` steps of each trainer in turn, evaluated every ``wl.eval_every`` steps and at
    the end; per mode its ``(step, metric)`` evaluations."""
    evals: dict[str, list[tuple[int, float]]] = {m: [] for m in trainers}
    for step in range(1, steps + 1):
        for m, t in trainers.items():
            t.step()
            if step % wl.eval_every == 0 or step == steps:
                evals[m].append((step, t.evaluate()))
        if step % max(1, steps // 10) == 0:
            log(f"  {label}: step {step}/{steps}")
    return evals


def train(name: str, seed: int, modes: list[str], dtype: torch.dtype, steps: int | None,
          log: Any = print) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Train ``modes`` round-robin on workload ``name``; per mode its evaluations and skips."""
    wl = WORKLOADS[name]
    data = wl.prepare(False, seed)
    steps = steps or wl.steps
    trainers = {m: Trainer(wl, data, MODES[m][0], dtype, wl.batch_size, seed, MODES[m][1])
                for m in modes}  # fmt: skip
    evals = round_robin(wl, trainers, steps, log, f"{name} seed {seed}")
    out = {}
    for m, t in trainers.items():
        reached = [
            s for s, v in evals[m] if (v >= wl.target if wl.higher_is_better else v <= wl.target)
        ]
        out[m] = dict(
            evals=evals[m],
            final=evals[m][-1][1],
            to_target=reached[0] if reached else None,
            skipped=t.skipped_steps,
        )
    return out


def table(name: str, runs: list[dict[str, dict[str, Any]]]) -> str:
    wl = WORKLOADS[name]
    modes = list(runs[0])
    pct = wl.metric == "accuracy"

    def show(v: float) -> str:
        return f"{v * 100:.2f}%" if pct else f"{v:.4f}"

    finals = {m: [r[m]["final"] for r in runs] for m in modes}
    base = statistics.fmean(finals["fp32"]) if "fp32" in finals else None
    lines = [
        f"| mode | final {wl.metric} (mean of {len(runs)}) | per seed | vs fp32 | "
        f"steps to {show(wl.target)} | skipped steps |",
        "|---|---|---|---|---|---|",
    ]
    for m in modes:
        mean = statistics.fmean(finals[m])
        diff = "-" if base is None or m == "fp32" else (
            f"{(mean - base) * 100:+.2f} points" if pct else f"{mean - base:+.4f}"
        )  # fmt: skip
        reached = [r[m]["to_target"] for r in runs if r[m]["to_target"] is not None]
        to = f"{statistics.fmean(reached):.0f}" if reached else "not reached"
        if reached and len(reached) < len(runs):
            to += f" ({len(reached)} of {len(runs)} seeds)"
        lines.append(
            f"| {m} | {show(mean)} | {', '.join(show(v) for v in finals[m])} | {diff} | {to} | "
            f"{sum(r[m]['skipped'] for r in runs)} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", default=["mnist1d-cnn", "char-gpt"],
                   choices=list(WORKLOADS))  # fmt: skip
    p.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    p.add_argument("--code-all-states", action="store_true",
                   help="8/4-bit states also below 4096 elements (all of the CNN's)")  # fmt: skip
    p.add_argument("--seeds", nargs="+", type=int, default=None,
                   help="default: 0 1 2 for mnist1d-cnn, 0 for char-gpt")  # fmt: skip
    p.add_argument("--steps", type=int, default=None, help="default: the workload's own")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.code_all_states:
        from mixprec._core.update import state_codes

        state_codes.MIN_NUMEL = 1
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    from mixprec._core.hardware import check

    header = (
        f"{datetime.date.today()} · {check(verbose=False).name} · {torch.get_num_threads()} "
        f"threads · torch {torch.__version__} · python {platform.python_version()} · "
        f"{args.dtype}"
    )
    print(header)
    doc: dict[str, Any] = dict(header=header, workloads={})
    for name in args.workloads:
        seeds = args.seeds or ([0, 1, 2] if name == "mnist1d-cnn" else [0])
        runs = [train(name, s, args.modes, dtype, args.steps) for s in seeds]
        text = table(name, runs)
        wl = WORKLOADS[name]
        print(f"\n**{name}** ({wl.description}, {args.steps or wl.steps} steps)\n\n{text}")
        doc["workloads"][name] = dict(seeds=seeds, runs=runs, table=text)
        if args.json:  # after every workload: an interrupted run keeps what finished
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
