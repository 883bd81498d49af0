"""Training steps on a CUDA GPU: GPT-2-small-shaped and ResNet-50-shaped, every mode in one run.

    python benchmarks/bench_gpu.py --device cuda --json results_gpu.json
    python benchmarks/bench_gpu.py --device cuda --quick     # the bf16 fair race alone
    python benchmarks/bench_gpu.py --device cpu --smoke     # the code path, tiny shapes (tests)

Synthetic data (random tokens / images: nothing is downloaded). The race is run fairly: eager
modes against torch.autocast eager, compiled modes (``+ compile``: ``torch.compile(model)``,
and the graph pass as a ``torch.compile`` backend) against torch.autocast + ``torch.compile``,
each of the same 16-bit dtype (fp32 rows against bf16 eager). Modes: fp32 with TF32 off and on;
torch.autocast fp16 (+ GradScaler) and bf16, eager and compiled; mixprec.autocast bf16; mixprec
O1/O2/O3 in fp16 and bf16, eager and compiled; O2/O3 bf16 with ``activations="fp8"``; the graph
pass under torch.compile; the ``"lean"`` recipe in bf16, eager and compiled; and, where torchao
is installed, bf16 weights stepped by torchao's ``AdamW8bit``, compiled. Every round times
every mode for ``--steps`` steps, in turn; a ratio is the median of the per-round ratios, shown
with their range. Peak memory is the whole footprint of each mode's tensors (weights,
gradients, optimizer state, activations, workspace: ``torch.cuda.max_memory_allocated`` over
two steps right after the mode is built and warmed up, less what was allocated before it was
built), so each mode is compiled once. The header names GPU, driver, CUDA and torch.
``--quick`` runs the bf16 race alone (GPT-2-small, 3 rounds), the part of ``tools/gpu_check.sh
quick`` that fits a short GPU lease.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
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


#: bf16 weights stepped by torchao's 8-bit AdamW (``torchao.optim.AdamW8bit``), no mixprec
TORCHAO = "torchao-adamw8bit"


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
    Mode("mixprec lean bf16", "lean", BF16),
    Mode("mixprec lean bf16 + compile", "lean+compile", BF16),
    Mode("torchao AdamW8bit, bf16 weights + compile", TORCHAO + "+compile", BF16),
]


# the fair race in bf16, eager against eager and compiled against compiled (--quick); the
# torchao row only where torchao is installed
QUICK = [
    "torch.autocast bf16",
    "mixprec O2 bf16",
    "mixprec O3 bf16",
    "mixprec lean bf16",
    "torch.autocast bf16 + compile",
    "mixprec O2 bf16 + compile",
    "mixprec O3 bf16 + compile",
    "mixprec lean bf16 + compile",
    "torchao AdamW8bit, bf16 weights + compile",
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


def _torchao_trainer(wl: Any, m: Mode) -> Trainer:
    """The workload's model in bf16, stepped by torchao's ``AdamW8bit`` with the workload's
    AdamW hyperparameters; compiled as a user would where the mode says so."""
    from torchao.optim import AdamW8bit

    t = Trainer(wl, None, "fp32", m.dtype, 0, 0)
    t.model = t.model.to(m.dtype)
    keys = ("lr", "betas", "eps", "weight_decay")
    t.opt = AdamW8bit(t.model.parameters(), **{k: t.opt.param_groups[0][k] for k in keys})
    if m.compiled:
        t.model = torch.compile(t.model)
    return t


def _build(wl: Any, m: Mode, device: str, row: Row) -> Trainer | None:
    """Build one mode and warm it up (compilation included). On a GPU, the mode's whole
    footprint is measured here, over two steps after the warm-up: what it allocates above what
    was live before it was built (the modes built earlier stay idle meanwhile), so each peak is
    the mode's own and no mode is compiled twice."""
    _tf32(m.tf32)
    cuda = device == "cuda"
    try:
        base = torch.cuda.memory_allocated() if cuda else 0
        if m.trainer_mode.startswith(TORCHAO):
            t = _torchao_trainer(wl, m)
        else:
            t = Trainer(wl, None, m.trainer_mode, m.dtype, 0, 0, m.options())
        t.step()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t.step()
            t.step()
            row.peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
        return t
    except Exception as e:  # noqa: BLE001 - a mode that cannot run is reported, not fatal
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return None


def _race(
    trainers: dict[str, Trainer], res: dict[str, Row], modes, rounds, steps, log, deadline
) -> None:
    """Round 0 warms up (2 steps: building warmed each mode up already); every later round
    times each mode for ``steps`` steps, in turn. No round starts past ``deadline`` (a
    ``time.monotonic()``; 0: none) once one round has been timed."""
    for r in range(rounds + 1):
        if r > 1 and deadline and time.monotonic() > deadline:
            log(f"stopped after {r - 1} timed rounds: the time budget is spent")
            break
        for m in modes:
            t = trainers.get(m.label)
            if t is None:
                continue
            _tf32(m.tf32)
            try:
                n = steps if r else min(steps, 2)
                dt = sum(t.step()[0] for _ in range(n)) / n
            except Exception as e:  # noqa: BLE001 - reported in its row
                res[m.label].error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                del trainers[m.label]
                continue
            if r:
                res[m.label].times.append(dt)
        log(f"round {r}/{rounds}")


def _ratios(res: dict[str, Row]) -> None:
    """Speed and memory against each row's reference: medians of the per-round ratios."""
    for row in res.values():
        ref = res.get(row.reference_label)
        if ref is None:
            continue
        if ref.times and row.times:
            ratios = [b / a for a, b in zip(row.times, ref.times)]
            row.vs_torch = statistics.median(ratios)
            row.vs_torch_range = (min(ratios), max(ratios))
        if row.peak_mb is not None and ref.peak_mb:
            row.peak_vs_torch = row.peak_mb / ref.peak_mb


def run(
    device: str,
    smoke: bool,
    rounds: int,
    steps: int,
    modes: list[Mode],
    log: Any = print,
    only: list[str] | None = None,
    budget_s: float = 0,
) -> list[Row]:
    """Race ``modes`` on each workload (``only``: these workloads). ``budget_s`` (0: none): no
    mode is built after 70% of it is spent, and no timed round starts after all of it."""
    rows: list[Row] = []
    start = time.monotonic()
    deadline = start + budget_s if budget_s else 0
    for name, (wl, items, unit) in workloads(device, smoke).items():
        if only and name not in only:
            continue
        res = {m.label: Row(name, m.label, items, unit, reference_label=m.reference) for m in modes}
        trainers = {}
        for m in modes:
            if budget_s and time.monotonic() - start > 0.7 * budget_s:
                res[m.label].error = "not run: the time budget was spent building earlier modes"
                continue
            t = _build(wl, m, device, res[m.label])
            if t is not None:
                trainers[m.label] = t
            log(f"{name}: built {m.label}" if t else f"{name}: {m.label}: {res[m.label].error}")
        say = lambda s, name=name: log(f"{name}: {s}")  # noqa: E731
        _race(trainers, res, modes, rounds, steps, say, deadline)
        for label, t in trainers.items():
            res[label].final_loss = t.step()[1]
            res[label].skipped = t.skipped_steps
        del trainers
        _ratios(res)
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
        from mixprec._core.hardware import check

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
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; quick 3)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode per round")
    p.add_argument("--modes", nargs="+", help="labels to run (default: all)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument(
        "--budget-s", type=float, default=0, help="seconds to build and race in (0: no limit)"
    )
    p.add_argument("--markdown", help="also write the header and table to this file")
    p.add_argument(
        "--quick",
        action="store_true",
        help="the bf16 fair race alone on GPT-2-small, eager and compiled, 3 rounds (modes: "
        + ", ".join(QUICK)
        + "); with --device cpu --smoke, the same code path in tiny shapes",
    )
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
    labels = args.modes or (QUICK if args.quick else None)
    by_label = {m.label: m for m in MODES}
    modes = [by_label[x] for x in labels if x in by_label] if labels else list(MODES)
    if importlib.util.find_spec("torchao") is None:  # its row only where it is installed
        modes = [m for m in modes if not m.trainer_mode.startswith(TORCHAO)]
    if args.device == "cpu" and not args.quick:  # compiling every mode would take many minutes
        modes = [m for m in modes if not m.compiled]
    rounds = args.rounds or (3 if args.quick else 5)
    if args.profile:
        print(f"{machine(args.device)} · torch {torch.__version__}\n")
        print(profile_modes(args.device, args.smoke, modes))
        return
    t0 = time.time()
    only = ["gpt2-small"] if args.quick else None
    rows = run(
        args.device, args.smoke, rounds, args.steps, modes, only=only, budget_s=args.budget_s
    )
    header = (
        f"{datetime.date.today()} · {machine(args.device)} · torch {torch.__version__} · "
        f"{rounds} rounds x {args.steps} steps · {time.time() - t0:.0f} s"
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
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"{header}\n\n{format_table(rows)}\n")


if __name__ == "__main__":
    main()
