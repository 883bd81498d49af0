"""Whole-footprint memory of one training step, a fresh process per mode; activations options.

    python benchmarks/bench_memory.py                      # all modes, the GPT, 2 runs each
    python benchmarks/bench_memory.py --modes torch-autocast O2 O3+fp8 --runs 3
    python benchmarks/bench_memory.py --train 300          # + loss and step time per option
    python benchmarks/bench_memory.py --modes --train 300 --train-modes O3 O3+fp8
    python benchmarks/bench_memory.py --json out.json

Memory. Each mode runs in a fresh Python process (imports, model, optimizer, ``--steps``
training steps), so nothing another mode allocated is counted. Three figures per mode:

* **process peak**: the process's resident-set high-water mark (``VmHWM``), everything
  included -- the Python and torch runtime (the "runtime" column, read after the imports,
  ``torch._dynamo`` among them: building any torch optimizer imports it),
  weights, gradients, optimizer state, activations, and what the C allocator kept;
* **added**: process peak minus the runtime;
* **tensor peak**: the largest total of live tensor bytes during one profiled step
  (``torch.profiler`` with ``profile_memory``), the figure CUDA's ``max_memory_allocated``
  gives on a GPU. On a CPU the allocator (glibc malloc) keeps freed blocks, so the process
  peak carries a mode-dependent slack on top of this; ``--mmap-threshold 65536`` runs the
  processes with glibc returning freed blocks of 64 KiB and more, which removes most of it.

"saved" is what autograd keeps for backward after one forward, weights and their 16-bit copies
excluded, in MB (for ``activations=``, what the storage hooks keep: FP8 data and scales, 16-bit
copies, nothing for a recomputed output). Ratios are of the medians over ``--runs`` fresh
processes, against torch.autocast.

Training (``--train N``): the levels with and without each activations option train the
character GPT on the standard-library corpus from the same seed on the same batches, taking
turns step by step in one process; the table gives the mean loss of the last 20 steps and the
median step time, each as a ratio against the same level without the option.

Modes: ``fp32``, ``torch-autocast`` (bf16; with ``--dtype fp16`` a GradScaler too), ``O1``,
``O2``, ``O3``, a level with ``+fp8`` / ``+recompute`` / ``+16-bit`` (the ``activations=``
option), and any mode with ``@compile`` (``torch.compile(model)``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

MODES = (
    "fp32",
    "torch-autocast",
    "O1",
    "O2",
    "O3",
    "O1+16-bit",
    "O1+recompute",
    "O1+fp8",
    "O2+recompute",
    "O2+fp8",
    "O3+recompute",
    "O3+fp8",
)
TRAIN = ("O1", "O1+fp8", "O2", "O2+fp8", "O3", "O3+recompute", "O3+fp8")
_LEVELS = ("O1", "O2", "O3")


def parse_mode(mode: str) -> tuple[str, str | None, bool]:
    """``"O3+fp8@compile"`` -> ``("O3", "fp8", True)``."""
    base, _, tail = mode.partition("@")
    if tail not in ("", "compile"):
        raise ValueError(f"Unknown suffix @{tail} in {mode!r}; only @compile is known.")
    level, _, act = base.partition("+")
    if level not in ("fp32", "torch-autocast", *_LEVELS):
        raise ValueError(
            f"Unknown mode {mode!r}: fp32, torch-autocast or O1-O3, optionally +fp8, "
            "+recompute or +16-bit (levels only) and @compile."
        )
    if act and level not in _LEVELS:
        raise ValueError(f"{mode!r}: activations= options apply to the levels O1-O3.")
    return level, act or None, tail == "compile"


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def build(mode: str, dtype: torch.dtype, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """(model, optimizer, region, scaler) of ``mode`` for the benchmark GPT."""
    import mixprec
    from mixprec.bench.models import GPT, GPTConfig

    level, act, compiled = parse_mode(mode)
    torch.manual_seed(seed)
    model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    region, scaler = contextlib.nullcontext, None
    if level in _LEVELS:
        model, opt = mixprec.initialize(model, opt, mixprec.Recipe(level, dtype, activations=act))
    elif level == "torch-autocast":
        region = lambda: torch.autocast("cpu", dtype)  # noqa: E731
        if dtype == torch.float16:
            scaler = torch.amp.GradScaler("cpu")
    if compiled:
        model = torch.compile(model)
    return model, opt, region, scaler


def step(model: Any, opt: Any, region: Any, scaler: Any, x: Any, y: Any) -> float:
    with region():
        logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    if hasattr(opt, "backward"):
        opt.backward(loss)
        opt.step()
    elif scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _batch(batch: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 96, (batch, 256), generator=g), torch.randint(
        0, 96, (batch, 256), generator=g
    )


def _saved_mb(model: Any, region: Any, x: Any, storage: bool) -> float:
    """MB autograd keeps after one forward: what mixprec's storage hooks keep where the mode has
    them (``storage``), else what a saved-tensor hook around the forward sees (the storage
    hooks step aside inside a caller's own hooks, so the two cannot be combined)."""
    from mixprec._core import activations

    kept: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def size(obj: Any) -> int:
        if isinstance(obj, torch.Tensor):
            return obj.untyped_storage().nbytes()
        if isinstance(obj, activations._Packed):
            if isinstance(obj.data, torch.Tensor):  # a 16-bit copy
                return obj.data.numel() * obj.data.element_size()
            return obj.data.data.numel() + obj.data.scale.numel() * 4  # FP8 + scales
        return 0  # recomputed in backward

    def note(obj: Any) -> Any:
        key = obj.untyped_storage().data_ptr() if isinstance(obj, torch.Tensor) else id(obj)
        if key not in weights and not (
            isinstance(obj, torch.Tensor) and activations._is_weight(obj)
        ):
            kept[key] = size(obj)
        return obj

    original = activations.SavedTensorStorage._pack
    activations.SavedTensorStorage._pack = lambda self, t: note(original(self, t))
    outer = (
        contextlib.nullcontext()
        if storage
        else torch.autograd.graph.saved_tensors_hooks(note, lambda p: p)
    )
    try:
        with outer, region():
            out = model(x)
    finally:
        activations.SavedTensorStorage._pack = original
    del out
    return sum(kept.values()) / 1e6


def _tensor_peak(fn: Any) -> int:
    """Largest total of live CPU tensor bytes while ``fn`` runs (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        fn()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    return max(sum(row) for row in sizes)


def child(mode: str, dtype: torch.dtype, steps: int, batch: int) -> dict[str, Any]:
    import torch._dynamo  # noqa: F401  every torch optimizer imports it when built (73 MB here)

    runtime = _rss("VmRSS")
    model, opt, region, scaler = build(mode, dtype)
    x, y = _batch(batch)
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step(model, opt, region, scaler, x, y))
        times.append(time.perf_counter() - t0)
    peak = _rss("VmHWM")
    saved = _saved_mb(model, region, x, storage=parse_mode(mode)[1] is not None)
    opt.zero_grad(set_to_none=True)
    tensor = _tensor_peak(lambda: step(model, opt, region, scaler, x, y))
    return dict(
        mode=mode,
        runtime_mb=runtime / 1e6,
        peak_mb=peak / 1e6,
        added_mb=(peak - runtime) / 1e6,
        tensor_mb=tensor / 1e6,
        saved_mb=saved,
        step_ms=statistics.median(times[1:] or times) * 1e3,
        loss=losses[-1],
    )


def measure(
    modes: list[str],
    runs: int,
    dtype_name: str,
    steps: int,
    batch: int,
    mmap_threshold: int | None = None,
) -> list[dict]:
    env = dict(os.environ)
    if mmap_threshold is not None:  # glibc: blocks this large are mapped, and unmapped on free
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    rows = []
    for mode in modes:
        samples = []
        for r in range(runs):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    mode,
                    "--dtype",
                    dtype_name,
                    "--steps",
                    str(steps),
                    "--batch",
                    str(batch),
                ],
                capture_output=True,
                text=True,
                check=False,
                env=env,
            )
            if out.returncode:
                raise RuntimeError(f"{mode} run {r} failed:\n{out.stderr[-3000:]}")
            samples.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  {mode} run {r + 1}/{runs}: {samples[-1]['peak_mb']:.0f} MB", flush=True)
        row = {k: statistics.median(s[k] for s in samples) for k in samples[0] if k != "mode"}
        row.update(mode=mode, runs=[s["peak_mb"] for s in samples])
        rows.append(row)
    return rows


def memory_table(rows: list[dict]) -> str:
    ref = next((r for r in rows if r["mode"] == "torch-autocast"), None)
    fp32 = next((r for r in rows if r["mode"] == "fp32"), None)

    def ratio(r: dict, base: dict | None, key: str) -> str:
        return "-" if base is None else f"{r[key] / base[key]:.2f}x"

    lines = [
        "| mode | process peak (MB) | vs torch.autocast | vs fp32 | added (MB) | vs torch.autocast "
        "| tensor peak (MB) | vs torch.autocast | vs fp32 | saved (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        runs = "–".join(f"{v:.0f}" for v in (min(r["runs"]), max(r["runs"])))
        lines.append(
            f"| {r['mode']} | {r['peak_mb']:.0f} ({runs}) | {ratio(r, ref, 'peak_mb')} | "
            f"{ratio(r, fp32, 'peak_mb')} | {r['added_mb']:.0f} | {ratio(r, ref, 'added_mb')} | "
            f"{r['tensor_mb']:.0f} | {ratio(r, ref, 'tensor_mb')} | {ratio(r, fp32, 'tensor_mb')} "
            f"| {r['saved_mb']:.0f} |"
        )
    return "\n".join(lines)


def train(modes: list[str], steps: int, dtype: torch.dtype, seed: int = 0) -> list[dict]:
    """Interleaved training on the character corpus; loss and step time per mode."""
    from mixprec.bench.workloads import corpus_batches, prepare_corpus

    data = prepare_corpus(quick=False, seed=seed)
    runs = {}
    for mode in modes:
        model, opt, region, scaler = build(mode, dtype, seed)
        runs[mode] = (model, opt, region, scaler, corpus_batches(data, 16, seed), [], [])
    for i in range(steps):
        for model, opt, region, scaler, batches, losses, times in runs.values():
            x, y = next(batches)
            t0 = time.perf_counter()
            losses.append(step(model, opt, region, scaler, x, y))
            times.append(time.perf_counter() - t0)
        if (i + 1) % 50 == 0:
            print(f"  step {i + 1}/{steps}", flush=True)
    rows = []
    for mode, (*_, opt, _r, _s, _b, losses, times) in runs.items():
        rows.append(
            dict(
                mode=mode,
                final_loss=statistics.fmean(losses[-20:]),
                step_ms=statistics.median(times[1:]) * 1e3,
                skipped=int(getattr(opt, "skipped_steps", 0)),
                losses=losses,
            )
        )
    return rows


def train_table(rows: list[dict]) -> str:
    by = {r["mode"]: r for r in rows}
    lines = [
        "| mode | loss, last 20 steps | vs level alone | median step (ms) | vs level alone "
        "| skipped |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = by.get(parse_mode(r["mode"])[0])
        same = base is None or base is r
        dl = "-" if same else f"{r['final_loss'] / base['final_loss'] - 1:+.2%}"
        dt = "-" if same else f"{r['step_ms'] / base['step_ms']:.2f}x"
        lines.append(
            f"| {r['mode']} | {r['final_loss']:.4f} | {dl} | {r['step_ms']:.0f} | {dt} "
            f"| {r['skipped']} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="*", default=list(MODES), help="none: training only")
    p.add_argument("--runs", type=int, default=2, help="fresh processes per mode")
    p.add_argument("--steps", type=int, default=3, help="training steps per process")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--train", type=int, default=0, help="also train TRAIN modes this many steps")
    p.add_argument("--train-modes", nargs="+", default=list(TRAIN))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--mmap-threshold",
        type=int,
        default=None,
        help="run the processes with glibc's MALLOC_MMAP_THRESHOLD_ fixed at this many bytes, "
        "so freed large blocks go back to the system (the process peak then follows live memory)",
    )
    p.add_argument("--json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if args.child:
        print(json.dumps(child(args.child, dtype, args.steps, args.batch)))
        return
    for m in (*args.modes, *args.train_modes):
        parse_mode(m)
    from mixprec._core.hardware import check

    header = (
        f"{datetime.date.today()} · {check(verbose=False).name} · {torch.get_num_threads()} "
        f"threads · torch {torch.__version__} · python {platform.python_version()} · "
        f"{args.dtype} · GPT 4x384, T 256, batch {args.batch}, AdamW"
    )
    if args.mmap_threshold is not None:
        header += f" · MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}"
    print(header)
    doc: dict[str, Any] = dict(header=header)
    if args.modes:
        rows = measure(
            args.modes, args.runs, args.dtype, args.steps, args.batch, args.mmap_threshold
        )
        doc.update(memory=rows, memory_table=memory_table(rows))
        print(doc["memory_table"])
    if args.train:
        trained = train(args.train_modes, args.train, dtype)
        doc["train"], doc["train_table"] = trained, train_table(trained)
        print(doc["train_table"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
