"""Host cost of each mode: forward and training step of a launch-bound and a mid-size model.

    python benchmarks/bench_overhead.py                     # CPU, bf16, both models
    python benchmarks/bench_overhead.py --device cuda --dtype fp16 --json out.json

The launch-bound model (a 12-layer GPT of width 32, context 8, batch 1) has tensors so small
that kernel time is ~0: its time is the per-op host cost of each mode -- what decides speed on
a GPU for every model that is not huge. The mid-size model (4 layers, width 256, context 128,
batch 8) shows the same modes where the kernels matter too. Every round runs every mode once,
in turn; ratios are medians of per-round ratios against torch.autocast measured in the same
run, and "extra us per call" divides the time difference by the Python-level torch calls of one
fp32 forward. The header names the machine (CPU model and flags, or GPU, driver) and torch.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mixprec._core.hardware import check
from mixprec.bench.models import GPT, GPTConfig
from mixprec.bench.runner import Trainer
from mixprec.bench.steps import emit, step_workload

MODES = ("fp32", "torch-autocast", "mixprec-autocast", "O1", "O2", "O3", "graph")
MODELS = {
    "launch-bound": (GPTConfig(vocab_size=96, block_size=8, n_layer=12, n_head=2, n_embd=32), 1),
    "mid-size": (GPTConfig(vocab_size=96, block_size=128, n_layer=4, n_head=4, n_embd=256), 8),
}


class _CallCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _workload(name: str, device: str) -> Any:
    cfg, batch = MODELS[name]

    def batch_fn(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
        y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
        return x.to(device), y.to(device)

    return step_workload(
        name,
        f"GPT {cfg.n_layer}x{cfg.n_embd}, context {cfg.block_size}, batch {batch}",
        lambda: GPT(cfg).to(device),
        lambda params: torch.optim.AdamW(params, lr=1e-3),
        batch_fn,
    )


def _forward_timer(trainer: Trainer, x: torch.Tensor, n: int, device: str) -> Any:
    def run() -> float:
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(n):
                trainer.forward(x)
        _sync(device)
        return (time.perf_counter() - t0) / n

    return run


def _step_timer(trainer: Trainer, n: int) -> Any:
    def run() -> float:
        return sum(trainer.step()[0] for _ in range(n)) / n

    return run


def measure(
    model: str, phase: str, modes: list[str], rounds: int, dtype: torch.dtype, device: str
) -> list[dict[str, Any]]:
    wl = _workload(model, device)
    x, _ = wl.example_batch(None, 0)
    launch = model == "launch-bound"
    n = (20 if launch else 3) if phase == "forward" else (5 if launch else 1)
    trainers = {m: Trainer(wl, None, m, dtype, 0, 0) for m in modes}
    timers = {
        m: (_forward_timer(t, x, n, device) if phase == "forward" else _step_timer(t, n))
        for m, t in trainers.items()
    }
    with _CallCounter() as counter, torch.no_grad():
        trainers[modes[0]].model(x)
    times: dict[str, list[float]] = {m: [] for m in modes}
    failed: dict[str, str] = {}
    for r in range(rounds + 1):
        for m in modes:
            if m in failed:
                continue
            try:
                dt = timers[m]()
            except Exception as e:  # noqa: BLE001 - one broken mode must not hide the others
                failed[m] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
                continue
            if r:  # round 0 warms up (and compiles)
                times[m].append(dt)
    ref = times.get("torch-autocast")
    rows = [{"model": model, "phase": phase, "mode": m, "error": e} for m, e in failed.items()]
    for m in [m for m in modes if m not in failed]:
        med = statistics.median(times[m])
        ratio = statistics.median(a / b for a, b in zip(times[m], ref)) if ref else None
        extra = (med - statistics.median(ref)) / counter.calls * 1e6 if ref else None
        rows.append(
            {
                "model": model,
                "phase": phase,
                "mode": m,
                "ms": med * 1e3,
                "vs_torch": ratio,
                "extra_us_per_call": extra,
                "calls": counter.calls,
            }
        )
    return rows


def machine(device: str) -> str:
    report = check(device, verbose=False)
    if device == "cuda":
        driver = torch.cuda.get_device_properties(0)
        return (
            f"{report.name} ({driver.major}.{driver.minor} capability), CUDA {torch.version.cuda}"
        )
    return (
        f"{report.name} [{' '.join(report.features) or 'no AVX512/AMX flags'}], "
        f"{torch.get_num_threads()} threads"
    )


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | phase | mode | median (ms) | x torch.autocast | extra us/call |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(
                f"| {r['model']} | {r['phase']} | {r['mode']} | failed: {r['error']} | | |"
            )
            continue
        ratio = "-" if r["vs_torch"] is None else f"{r['vs_torch']:.2f}x"
        extra = "-" if r["extra_us_per_call"] is None else f"{r['extra_us_per_call']:+.1f}"
        lines.append(
            f"| {r['model']} | {r['phase']} | {r['mode']} | {r['ms']:.3f} | {ratio} | {extra} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--phases", nargs="+", default=["forward", "step"], choices=["forward", "step"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json", help="also write the rows to this JSON file")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch on this machine.")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    header = (
        f"{datetime.date.today()} · {machine(args.device)} · torch {torch.__version__} · "
        f"{args.dtype} · {args.rounds} rounds"
    )
    rows = []
    for model in args.models:
        for phase in args.phases:
            rows += measure(model, phase, args.modes, args.rounds, dtype, args.device)
            print(f"{model} {phase} done", flush=True)
    emit(header, format_table(rows), args.json, {"rows": rows})


if __name__ == "__main__":
    main()
