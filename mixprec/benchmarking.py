"""Step-time and memory benchmarks: every mode in one process, as ratios, interleaved.

Design (``shared/reference/PERF_NOTES.md``): absolute times on a shared machine drift 10-20% over
an hour and identical code differs by up to 7% between rounds, so each round times every mode
once, in turn, and speed-ups are the median of the per-round ratios -- never numbers from
different runs. Peak memory is measured in a separate pass (one mode at a time, model and
optimizer built inside the measurement) so the timing rounds are not disturbed.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.memory import PeakMemory
from mixprec.models import GPT, GPTConfig, SeedMLP

__all__ = ["MODES", "WORKLOADS", "Workload", "build_step", "run", "format_table"]

MODES = ("fp32", "torch-autocast", "mixprec-autocast", "O1", "O2", "O3")


@dataclass(frozen=True)
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    make_optimizer: Callable[[Any], torch.optim.Optimizer]
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    description: str = ""


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


WORKLOADS: dict[str, Workload] = {
    "seed-mlp": Workload(
        "seed-mlp", lambda: SeedMLP(784, 4096, 10),
        lambda params: torch.optim.SGD(params, lr=0.01),
        lambda g: (torch.randn(512, 784, generator=g), torch.randint(0, 10, (512,), generator=g)),
        _ce, "Linear 784-4096-4096-10, ReLU, fp32 softmax cross-entropy, batch 512, SGD"),
    "gpt": Workload(
        "gpt", lambda: GPT(GPTConfig()),
        lambda params: torch.optim.AdamW(params, lr=1e-3),
        lambda g: (torch.randint(0, 96, (16, 256), generator=g),
                   torch.randint(0, 96, (16, 256), generator=g)),
        _ce, "4 layers, width 384, 6 heads, context 256, batch 16, AdamW"),
}


def build_step(workload: Workload, mode: str, dtype: torch.dtype = torch.bfloat16,
               seed: int = 0) -> Callable[[], float]:
    """Build model, optimizer and data for ``mode``; return a function running one step."""
    if mode not in MODES:
        raise ValueError(f"Unknown mode {mode!r}; expected one of {MODES}.")
    torch.manual_seed(seed)
    model = workload.make_model()
    opt = workload.make_optimizer(model.parameters())
    x, y = workload.make_batch(torch.Generator().manual_seed(seed))
    if mode in ("O1", "O2", "O3"):
        model, opt = mixprec.initialize(model, opt, level=mode, dtype=dtype)

        def step() -> float:
            loss = workload.loss_fn(model(x), y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
        return step

    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    region: Callable[[], Any] = {
        "fp32": contextlib.nullcontext,
        "torch-autocast": lambda: torch.autocast(x.device.type, dtype),
        "mixprec-autocast": lambda: mixprec.autocast(dtype),
    }[mode]

    def plain_step() -> float:
        with region():
            loss = workload.loss_fn(model(x), y)
        if scaler is not None and mode == "torch-autocast":
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return plain_step


@dataclass
class Result:
    workload: str
    mode: str
    times: list[float] = field(default_factory=list)
    vs_fp32: float | None = None
    vs_torch: float | None = None
    peak_bytes: int | None = None
    final_loss: float | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def _ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(b, a))  # speed-up of a over b


def run(workloads: list[str], modes: list[str], rounds: int = 7, warmup: int = 2,
        dtype: torch.dtype = torch.bfloat16, memory: bool = True,
        log: Callable[[str], None] = print) -> list[Result]:
    """Time every mode of every workload in interleaved rounds; measure peak memory after."""
    results: list[Result] = []
    for wname in workloads:
        wl = WORKLOADS[wname]
        steps = {m: build_step(wl, m, dtype) for m in modes}
        res = {m: Result(wname, m) for m in modes}
        for r in range(warmup + rounds):
            for m in modes:
                t0 = time.perf_counter()
                loss = steps[m]()
                dt = time.perf_counter() - t0
                if r >= warmup:
                    res[m].times.append(dt)
                res[m].final_loss = loss
            log(f"{wname}: round {r + 1}/{warmup + rounds} done")
        for m in modes:
            if "fp32" in res:
                res[m].vs_fp32 = _ratio(res[m].times, res["fp32"].times)
            if "torch-autocast" in res:
                res[m].vs_torch = _ratio(res[m].times, res["torch-autocast"].times)
        del steps
        if memory:
            for m in modes:
                with PeakMemory() as pm:
                    step = build_step(wl, m, dtype)
                    step()
                    step()
                    del step
                res[m].peak_bytes = pm.peak_bytes
        results.extend(res.values())
    return results


def format_table(results: list[Result]) -> str:
    """Markdown table of results."""
    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = ["| workload | mode | median step (s) | speed-up vs fp32 | vs torch.autocast | "
             "peak memory (MB) |", "|---|---|---|---|---|---|"]
    for r in results:
        mem = None if r.peak_bytes is None else r.peak_bytes / 2**20
        lines.append(f"| {r.workload} | {r.mode} | {r.median:.3f} | {fmt(r.vs_fp32, '.2f')}x | "
                     f"{fmt(r.vs_torch, '.2f')}x | {fmt(mem, '.0f')} |")
    return "\n".join(lines)
