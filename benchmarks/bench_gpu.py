"""Training steps on a CUDA GPU: GPT-2-small-shaped and ResNet-50-shaped, every mode in one run.

    python benchmarks/bench_gpu.py --device cuda --json results_gpu.json
    python benchmarks/bench_gpu.py --device cpu --smoke     # the code path, tiny shapes (tests)

Synthetic data (random tokens / images: nothing is downloaded). The race is run fairly: eager
modes against torch.autocast eager, compiled modes (``+ compile``: ``torch.compile(model)``, and
the graph pass as a ``torch.compile`` backend) against torch.autocast + ``torch.compile``, each
of the same 16-bit dtype (fp32 rows against bf16 eager). Modes: fp32 with TF32 off and on;
torch.autocast fp16 (+ GradScaler) and bf16, eager and compiled; mixprec.autocast bf16; mixprec
O1/O2/O3 in fp16 and bf16, eager and compiled; O2/O3 bf16 with ``activations="fp8"``; and the
graph pass under torch.compile. Every round times every mode for ``--steps`` steps, in turn;
a ratio is the median of the per-round ratios, shown with their range. Peak memory is the whole
footprint of one mode at a time (weights, gradients, optimizer state, activations:
``torch.cuda.max_memory_allocated`` over two steps of a freshly built mode, compiled ones
included). The header names GPU, driver, CUDA and torch.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from mixprec.bench.models import GPT, GPTConfig
from mixprec.bench.report import speed_words
from mixprec.bench.runner import Trainer
from mixprec.bench.steps import emit, step_workload

BF16, FP16 = torch.bfloat16, torch.float16
_NAME = {BF16: "bf16", FP16: "fp16"}


@dataclass(frozen=True)
class Mode:
    label: str
    trainer_mode: str
    dtype: torch.dtype
    tf32: bool = False
    activations: str | None = None

    @property
    def compiled(self) -> bool:
        return "compile" in self.trainer_mode

    @property
    def reference(self) -> str:
        """The torch.autocast mode this one races: same dtype, compiled or not."""
        if self.trainer_mode.startswith("fp32"):
            return "torch.autocast bf16"
        return f"torch.autocast {_NAME[self.dtype]}" + (" + compile" if self.compiled else "")

    def options(self) -> dict[str, Any]:
        return {} if self.activations is None else {"activations": self.activations}


MODES = [
    Mode("fp32", "fp32", BF16),
    Mode("fp32 + TF32", "fp32", BF16, tf32=True),
    *(
        Mode(f"torch.autocast {n}", "torch-autocast", d)
        for n, d in (("fp16", FP16), ("bf16", BF16))
    ),
    Mode("mixprec.autocast bf16", "mixprec-autocast", BF16),
    *(
        Mode(f"mixprec {lv} {n}", lv, d)
        for n, d in (("fp16", FP16), ("bf16", BF16))
        for lv in ("O1", "O2", "O3")
    ),
    *(
        Mode(f"mixprec {lv} bf16, activations=fp8", lv, BF16, activations="fp8")
        for lv in ("O2", "O3")
    ),
    *(
        Mode(f"torch.autocast {n} + compile", "torch-autocast+compile", d)
        for n, d in (("fp16", FP16), ("bf16", BF16))
    ),
    Mode("mixprec O2 fp16 + compile", "O2+compile", FP16),
    Mode("mixprec O3 fp16 + compile", "O3+compile", FP16),
    *(Mode(f"mixprec {lv} bf16 + compile", f"{lv}+compile", BF16) for lv in ("O1", "O2", "O3")),
    Mode("mixprec graph pass bf16 + compile", "graph+compile", BF16),
]


@dataclass
class Row:
    workload: str
    mode: str
    items_per_step: int
    unit: str
    times: list[float] = field(default_factory=list)
    vs_torch: float | None = None
    vs_torch_range: tuple[float, float] | None = None  # per-round ratios, lowest and highest
    peak_mb: float | None = None
    peak_vs_torch: float | None = None
    final_loss: float | None = None
    skipped: int = 0
    error: str | None = None
    reference_label: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def workloads(device: str, smoke: bool) -> dict[str, tuple[Any, int, str]]:
    """name -> (workload, items per step, unit)."""
    gcfg = (
        GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32)
        if smoke
        else GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    )
    gbatch = 2 if smoke else 8

    def tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, gcfg.vocab_size, (gbatch, gcfg.block_size + 1), generator=g)
        x = x.to(device)
        return x[:, :-1], x[:, 1:]

    out = {
        "gpt2-small": (
            step_workload(
                "gpt2-small",
                f"GPT {gcfg.n_layer}x{gcfg.n_embd}, context {gcfg.block_size}, batch "
                f"{gbatch}, AdamW",
                lambda: GPT(gcfg).to(device),
                lambda ps: torch.optim.AdamW(ps, lr=3e-4),
                tokens,
                _ce,
            ),
            gbatch * gcfg.block_size,
            "tokens",
        )
    }
    try:
        import torchvision
    except ImportError:
        return out
    side, ibatch = (32, 2) if smoke else (224, 64)

    def images(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(ibatch, 3, side, side, generator=g).to(device)
        return x, torch.randint(0, 1000, (ibatch,), generator=g).to(device)

    out["resnet50"] = (
        step_workload(
            "resnet50",
            f"ResNet-50, {side}x{side}, batch {ibatch}, SGD momentum",
            lambda: torchvision.models.resnet50(weights=None).to(device),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            images,
            lambda out, y: F.cross_entropy(out.float(), y),
        ),
        ibatch,
        "images",
    )
    return out


def _tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    if torch.cuda.is_available():  # cuDNN flags mean nothing on a CPU smoke run
        torch.backends.cudnn.allow_tf32 = on


def run(
    device: str, smoke: bool, rounds: int, steps: int, modes: list[Mode], log: Any = print
) -> list[Row]:
    rows: list[Row] = []
    for name, (wl, items, unit) in workloads(device, smoke).items():
        trainers = {}
        res = {m.label: Row(name, m.label, items, unit, reference_label=m.reference) for m in modes}
        for m in modes:
            _tf32(m.tf32)
            try:
                trainers[m.label] = Trainer(wl, None, m.trainer_mode, m.dtype, 0, 0, m.options())
            except Exception as e:  # noqa: BLE001 - a mode that cannot run is reported, not fatal
                res[m.label].error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        for r in range(rounds + 1):  # round 0: warm-up (and compilation)
            for m in modes:
                t = trainers.get(m.label)
                if t is None:
                    continue
                _tf32(m.tf32)
                try:
                    dt = sum(t.step()[0] for _ in range(steps)) / steps
                except Exception as e:  # noqa: BLE001 - reported in its row
                    res[m.label].error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    del trainers[m.label]
                    continue
                if r:
                    res[m.label].times.append(dt)
            log(f"{name}: round {r}/{rounds}")
        for m in modes:
            row, t = res[m.label], trainers.get(m.label)
            if t is None:
                continue
            row.final_loss = t.step()[1]
            row.skipped = t.skipped_steps
            ref = res.get(m.reference)
            if ref is not None and ref.times:
                ratios = [b / a for a, b in zip(row.times, ref.times)]
                row.vs_torch = statistics.median(ratios)
                row.vs_torch_range = (min(ratios), max(ratios))
        del trainers
        if device == "cuda":
            for m in modes:  # the whole footprint of each mode, built alone
                if res[m.label].error:
                    continue
                _tf32(m.tf32)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                t = Trainer(wl, None, m.trainer_mode, m.dtype, 0, 0, m.options())
                t.step()
                t.step()
                res[m.label].peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
                del t
            for row in res.values():
                ref = res.get(row.reference_label)
                if row.peak_mb is not None and ref is not None and ref.peak_mb:
                    row.peak_vs_torch = row.peak_mb / ref.peak_mb
        rows.extend(res.values())
    _tf32(False)
    return rows


def profile_modes(device: str, smoke: bool, modes: list[Mode], steps: int = 3) -> str:
    """Top kernels of ``steps`` steps of each mode (torch.profiler), as Markdown: where a mode
    spends its step, for comparing a slow mode with its torch.autocast reference."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    out = []
    for name, (wl, _, _) in workloads(device, smoke).items():
        for m in modes:
            _tf32(m.tf32)
            t = Trainer(wl, None, m.trainer_mode, m.dtype, 0, 0, m.options())
            t.step()  # warm-up (and compilation)
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    t.step()
            table = prof.key_averages().table(sort_by=sort, row_limit=12)
            out.append(f"### {name}: {m.label} ({steps} steps)\n\n```\n{table}\n```")
            del t
    _tf32(False)
    return "\n\n".join(out)


def machine(device: str) -> str:
    if device != "cuda":
        from mixprec.core.hardware import check

        return f"{check(device, verbose=False).name} (CPU smoke run)"
    try:
        driver = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            .stdout.strip()
            .splitlines()[0]
        )
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = "unknown"
    return f"{torch.cuda.get_device_name()}, driver {driver}, CUDA {torch.version.cuda}"


def format_table(rows: list[Row]) -> str:
    lines = [
        (
            "| workload | mode | step (ms) | throughput | speed vs its torch.autocast "
            "(per-round range) | peak memory (MB) | vs its torch.autocast | final loss | "
            "skipped |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error:
            lines.append(f"| {r.workload} | {r.mode} | failed: {r.error} | | | | | | |")
            continue
        if r.mode == r.reference_label:
            ratio = "reference"
        else:
            lo, hi = r.vs_torch_range or (float("nan"), float("nan"))
            ratio = f"{speed_words(r.vs_torch)} ({lo:.2f}–{hi:.2f}) vs {r.reference_label}"
        mem = "-" if r.peak_mb is None else f"{r.peak_mb:.0f}"
        mem_ratio = "-" if r.peak_vs_torch is None else f"{r.peak_vs_torch:.2f}x"
        lines.append(
            f"| {r.workload} | {r.mode} | {r.median * 1e3:.1f} | "
            f"{r.items_per_step / r.median:,.0f} {r.unit}/s | {ratio} | {mem} | {mem_ratio} | "
            f"{r.final_loss:.3f} | {r.skipped} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--smoke", action="store_true", help="tiny shapes: exercise the code path")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode per round")
    p.add_argument("--modes", nargs="+", help="labels to run (default: all)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of timing: print each selected mode's top kernels (torch.profiler)",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda: no CUDA GPU is visible to torch here. Run it on a GPU "
            "machine, or use --device cpu --smoke to exercise the code path."
        )
    if args.device == "cpu" and not args.smoke:
        raise SystemExit(
            "The GPU shapes would take hours on a CPU: pass --smoke with --device cpu."
        )
    modes = [m for m in MODES if not args.modes or m.label in args.modes]
    if args.device == "cpu":  # a smoke run: compiling every mode would take many minutes
        modes = [m for m in modes if not m.compiled]
    if args.profile:
        print(f"{machine(args.device)} · torch {torch.__version__}\n")
        print(profile_modes(args.device, args.smoke, modes))
        return
    t0 = time.time()
    rows = run(args.device, args.smoke, args.rounds, args.steps, modes)
    header = (
        f"{datetime.date.today()} · {machine(args.device)} · torch {torch.__version__} · "
        f"{args.rounds} rounds x {args.steps} steps · {time.time() - t0:.0f} s"
    )
    emit(
        header,
        format_table(rows),
        args.json,
        {
            "rows": [
                {
                    **{k: v for k, v in r.__dict__.items() if k != "times"},
                    "median": r.median,
                    "times": r.times,
                }
                for r in rows
            ]
        },
    )


if __name__ == "__main__":
    main()
