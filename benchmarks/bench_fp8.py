"""FP8 against bf16: the GEMMs, a GPT training step, and loss curves.

    python benchmarks/bench_fp8.py --device cuda --json results_fp8_h100.json   # the GPU table
    python benchmarks/bench_fp8.py --device cpu --json results_fp8_cpu.json     # the code path

Parts (``--parts``, default all three):

* ``gemm``: (a) the output GEMM of a Linear, M, K, N each in 1024 ... 16384 on a GPU (a CPU
  runs 128 ... 512: its FP8 is torch's emulation), FP8 tensorwise and rowwise
  (``torch._scaled_mm`` on pre-cast operands) against a bf16 ``mm``, next to the roofline's
  prediction for a whole Linear (``mixprec.fp8.choice``); then, for a few shapes, one
  Linear's forward and backward with its casts (``mixprec``'s FP8 linear, compiled on a GPU)
  against ``F.linear`` in bf16.
* ``step``: (b) a GPT training step (>= 350M parameters, d 2048 on a GPU; a small GPT on a CPU),
  all compiled on a GPU: bf16 O2, O2 + FP8 tensorwise, O2 + FP8 rowwise (every block Linear),
  O2 + FP8 with ``layers="auto"``, and torchao's float8 training where torchao is installed.
  Median step time, speed against bf16 O2 (ratio of the medians), and the whole peak memory of
  the process's tensors (``torch.cuda.max_memory_allocated``; on a CPU the resident-set peak of
  a step, measured with glibc's mmap threshold fixed so freed scratch leaves).
* ``curves``: (c) the loss of bf16 O2 and O2 + FP8 (both recipes) over the same batches of a
  synthetic Markov-chain language: 500 steps on a GPU, 300 on a CPU, for ``--seeds`` seeds; the
  final loss is the mean of the last 20 steps.

Modes run one after another (the GPU is otherwise idle); each timing is a median of rounds
after a warm-up that includes compilation. The header names the device and torch version.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import mixprec
from mixprec import FP8Config
from mixprec.bench.models import GPT, GPTConfig
from mixprec.fp8 import fp8_plan
from mixprec.fp8.choice import predicted_speedup
from mixprec.fp8.config import RECIPES
from mixprec.fp8.linear import fp8_linear
from mixprec.fp8.quantization import E4M3, quantize

BF16 = torch.bfloat16
RECIPE_NAMES = ("tensorwise", "rowwise")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def seconds(fn: Callable[[], Any], device: str, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters


def machine(device: str) -> str:
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        try:
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            ).stdout.split("\n")[0]
        except (OSError, subprocess.SubprocessError):
            driver = "unknown"
        return (
            f"{props.name} (compute capability {props.major}.{props.minor}), driver {driver}, "
            f"CUDA {torch.version.cuda}, torch {torch.__version__}"
        )
    report = mixprec.check("cpu", verbose=False)
    return (
        f"{report.name} ({' '.join(report.features)}), {torch.get_num_threads()} thread(s), "
        f"torch {torch.__version__}; FP8 emulated"
    )


# -- (a) GEMMs -----------------------------------------------------------------------------------
def gemm_part(device: str, sizes: list[int], rounds: int, layer_shapes: list[tuple]) -> dict:
    rows = []
    for m in sizes:
        for k in sizes:
            for n in sizes:
                g = torch.Generator(device=device).manual_seed(0)
                a = torch.randn(m, k, device=device, generator=g).to(BF16)
                b = torch.randn(n, k, device=device, generator=g).to(BF16)
                qa, qb = quantize(a, E4M3, None), quantize(b, E4M3, None)
                ra, rb = quantize(a, E4M3, -1, True), quantize(b, E4M3, -1, True)
                one = torch.ones((), device=device)
                fns = {
                    "bf16": lambda a=a, b=b: a @ b.t(),
                    "tensorwise": lambda qa=qa, qb=qb, one=one: torch._scaled_mm(
                        qa.data, qb.data.t(), one, one, out_dtype=BF16, use_fast_accum=True
                    ),
                    "rowwise": lambda ra=ra, rb=rb: torch._scaled_mm(
                        ra.data,
                        rb.data.t(),
                        ra.scale.reciprocal(),
                        rb.scale.reciprocal().reshape(1, -1),
                        out_dtype=BF16,
                        use_fast_accum=True,
                    ),
                }
                iters = max(1, min(50, int(2e11 / (2 * m * k * n)))) if device == "cuda" else 10
                times: dict[str, list[float]] = {name: [] for name in fns}
                for _ in range(rounds):
                    for name, fn in fns.items():
                        times[name].append(seconds(fn, device, iters))
                med = {name: statistics.median(t) for name, t in times.items()}
                flops = 2 * m * k * n
                row = {"M": m, "K": k, "N": n, "bf16_ms": med["bf16"] * 1e3}
                for r in RECIPE_NAMES:
                    row[f"{r}_ms"] = med[r] * 1e3
                    row[f"{r}_speedup"] = med["bf16"] / med[r]
                    row[f"{r}_roofline_layer"] = predicted_speedup(m, k, n, "h100", r)
                row["bf16_tflops"] = flops / med["bf16"] / 1e12
                rows.append(row)
                del a, b, qa, qb, ra, rb
    layers = []
    compile_it = device == "cuda"
    for m, k, n in layer_shapes:
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(m, k, device=device, generator=g).to(BF16).requires_grad_()
        w = (torch.randn(n, k, device=device, generator=g) / k**0.5).to(BF16).requires_grad_()
        dy = torch.randn(m, n, device=device, generator=g).to(BF16)
        fns: dict[str, Callable[..., torch.Tensor]] = {"bf16": F.linear}
        for r in RECIPE_NAMES:
            fns[r] = lambda x, w, r=r: fp8_linear(x, w, None, RECIPES[r], BF16)
        times = {}
        for name, fn in fns.items():
            f = torch.compile(fn) if compile_it else fn

            def step(f=f, x=x, w=w, dy=dy) -> None:
                x.grad = w.grad = None
                f(x, w).backward(dy)

            times[name] = statistics.median(
                seconds(step, device, 10 if device == "cuda" else 1) for _ in range(rounds)
            )
        row = {"M": m, "K": k, "N": n, "compiled": compile_it, "bf16_ms": times["bf16"] * 1e3}
        for r in RECIPE_NAMES:
            row[f"{r}_ms"] = times[r] * 1e3
            row[f"{r}_speedup"] = times["bf16"] / times[r]
            row[f"{r}_roofline"] = predicted_speedup(m, k, n, "h100", r)
        layers.append(row)
    return {"gemm": rows, "layer": layers}


def gemm_tables(part: dict) -> str:
    lines = [
        "(a) output GEMM, FP8 on pre-cast operands vs bf16 mm (speed = bf16 time / FP8 time;",
        "    roofline = predicted speed of a whole Linear's three GEMMs and casts on an H100)",
        "| M | K | N | bf16 (ms) | tensorwise | rowwise | roofline tw / rw |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in part["gemm"]:
        lines.append(
            f"| {r['M']} | {r['K']} | {r['N']} | {r['bf16_ms']:.3f} | "
            f"{r['tensorwise_speedup']:.2f}x | {r['rowwise_speedup']:.2f}x | "
            f"{r['tensorwise_roofline_layer']:.2f}x / {r['rowwise_roofline_layer']:.2f}x |"
        )
    lines += [
        "",
        "(a) one Linear, forward + backward with its casts, vs F.linear in bf16",
        "| M | K | N | compiled | bf16 (ms) | tensorwise | rowwise | roofline tw / rw |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in part["layer"]:
        lines.append(
            f"| {r['M']} | {r['K']} | {r['N']} | {'yes' if r['compiled'] else 'no'} | "
            f"{r['bf16_ms']:.2f} | {r['tensorwise_speedup']:.2f}x | {r['rowwise_speedup']:.2f}x "
            f"| {r['tensorwise_roofline']:.2f}x / {r['rowwise_roofline']:.2f}x |"
        )
    return "\n".join(lines)


# -- (b) a GPT training step ---------------------------------------------------------------------
STEP_MODES: dict[str, Any] = {
    "bf16 O2": None,
    "O2 + FP8 tensorwise": FP8Config("tensorwise", layers="all"),
    "O2 + FP8 rowwise": FP8Config("rowwise", layers="all"),
    "O2 + FP8 auto": FP8Config("tensorwise", layers="auto"),
    "torchao float8 tensorwise": "torchao",
}


# --quick: FP8 against bf16 on the GPT step alone, both recipes (the short GPU lease's part)
QUICK_STEP = ("bf16 O2", "O2 + FP8 tensorwise", "O2 + FP8 rowwise")
SMOKE = [False]  # --smoke: tiny shapes everywhere, to exercise the code path (tests)


def gpt_config(device: str) -> tuple[GPTConfig, int]:
    if SMOKE[0]:
        return GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32), 4
    if device == "cuda":  # 6 x 2048: 302M in the blocks + 2 x 65.5M embeddings and head
        return GPTConfig(vocab_size=32000, block_size=1024, n_layer=6, n_head=16, n_embd=2048), 8
    return GPTConfig(vocab_size=64, block_size=64, n_layer=4, n_head=4, n_embd=256), 16


def _build_step(device: str, mode: Any, cfg: GPTConfig, batch: int, compile_it: bool):
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if mode == "torchao":
        from torchao.float8 import convert_to_float8_training  # optional

        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "head")
        mode = None
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device == "cuda")
    model, opt = mixprec.initialize(model, opt, mixprec.Recipe("O2", BF16, fp8=mode))
    run = torch.compile(model) if compile_it else model
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), device=device, generator=g)
    idx, tgt = x[:, :-1], x[:, 1:]

    def step() -> float:
        logits = run(idx)
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), tgt.reshape(-1))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return model, step


def step_part(
    device: str,
    rounds: int,
    steps: int,
    compile_it: bool,
    labels: tuple[str, ...] = (),
    deadline: float = 0,
) -> dict:
    """GPU: one mode after another (each needs the memory; peaks are per mode). CPU: the models
    are small and the host is shared, so all are built first and timed in interleaved rounds.
    ``labels``: the modes to run (default: all of ``STEP_MODES``); no mode starts after
    ``deadline`` (a ``time.perf_counter()``; 0: none)."""
    cfg, batch = gpt_config(device)
    rows: list[dict[str, Any]] = []
    live: dict[str, Callable[[], Any]] = {}
    for label, mode in STEP_MODES.items():
        if labels and label not in labels:
            continue
        row: dict[str, Any] = {"mode": label, "times": []}
        if deadline and time.perf_counter() > deadline:
            rows.append({**row, "error": "not run: the time budget was spent"})
            continue
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            model, step = _build_step(device, mode, cfg, batch, compile_it)
            row["parameters"] = sum(p.numel() for p in model.parameters())
            for _ in range(3):  # warm-up: compilation, and "auto" decides
                row["final_loss"] = float(step())
            fp8 = mode not in (None, "torchao")
            row["fp8_layers"] = len(fp8_plan(model).chosen) if fp8 else 0
            if device == "cuda":
                row["times"] = [seconds(step, device, steps, warmup=0) for _ in range(rounds)]
                row["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
            else:
                live[label] = step
            del model
        except Exception as e:  # noqa: BLE001 - a mode that cannot run is reported in its row
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append(row)
    for _ in range(rounds if live else 0):
        for row in rows:
            if row["mode"] in live:
                row["times"].append(seconds(live[row["mode"]], device, steps, warmup=0))
    for row in rows:
        if row.get("times"):
            row["step_ms"] = statistics.median(row["times"]) * 1e3
    if device == "cpu" and not SMOKE[0]:
        for row in rows:
            if "error" not in row:
                row["peak_mb"] = _cpu_peak(row["mode"])
    base = next(r for r in rows if r["mode"] == "bf16 O2")
    for r in rows:
        if "step_ms" in r and "step_ms" in base:
            r["speed_vs_bf16"] = base["step_ms"] / r["step_ms"]
        if r.get("peak_mb") and base.get("peak_mb"):
            r["memory_vs_bf16"] = r["peak_mb"] / base["peak_mb"]
    return {"config": vars(cfg) | {"batch": batch, "compiled": compile_it}, "step": rows}


_CPU_PEAK = """
import sys, warnings, torch
warnings.simplefilter("ignore")
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[2])
import bench_fp8 as b
from mixprec._core.memory import PeakMemory
cfg, batch = b.gpt_config("cpu")
_, step = b._build_step("cpu", b.STEP_MODES[sys.argv[1]], cfg, batch, False)
step()
with PeakMemory() as peak:
    step()
print(peak.peak_bytes)
"""


def _cpu_peak(label: str) -> float | None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", _CPU_PEAK, label, here],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode:
        return None
    return int(out.stdout.split()[-1]) / 2**20


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def step_table(part: dict) -> str:
    c = part["config"]
    lines = [
        f"(b) GPT {c['n_layer']} x {c['n_embd']}, context {c['block_size']}, batch {c['batch']}, "
        f"vocab {c['vocab_size']}, AdamW, {'compiled' if c['compiled'] else 'eager'}",
        "| mode | FP8 layers | step (ms) | speed vs bf16 O2 | peak memory (MB) | vs bf16 O2 "
        "| loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in part["step"]:
        if "error" in r:
            lines.append(f"| {r['mode']} | failed: {r['error']} | | | | | |")
            continue
        mem = r.get("peak_mb")
        lines.append(
            f"| {r['mode']} | {r['fp8_layers']} | {r['step_ms']:.1f} | "
            f"{_ratio(r.get('speed_vs_bf16'))} | "
            f"{'-' if mem is None else f'{mem:.0f}'} | "
            f"{_ratio(r.get('memory_vs_bf16'))} | {r['final_loss']:.3f} |"
        )
    if lines and part["step"]:
        n = part["step"][0].get("parameters")
        lines.insert(1, f"    {n / 1e6:.0f}M parameters" if n else "")
    return "\n".join(lines)


# -- (c) loss curves -----------------------------------------------------------------------------
def markov(device: str, vocab: int, n: int, t: int, seed: int):
    table = torch.softmax(
        3 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(7)), -1
    ).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    while True:
        x = torch.empty(n, t + 1, dtype=torch.long, device=device)
        x[:, 0] = torch.randint(0, vocab, (n,), device=device, generator=g)
        for i in range(1, t + 1):
            x[:, i] = torch.multinomial(table[x[:, i - 1]], 1, generator=g).squeeze(1)
        yield x[:, :-1], x[:, 1:]


def curves_part(device: str, steps: int, seeds: int, compile_it: bool) -> dict:
    if device == "cuda":
        cfg, batch, lr = GPTConfig(512, 256, 4, 16, 1024), 16, 1e-3
    else:  # the model and data of tests/fp8/test_training.py
        cfg, batch, lr = GPTConfig(64, 32, 2, 4, 64), 16, 3e-3
    modes = {"bf16 O2": None, **{f"FP8 {r}": FP8Config(r, layers="all") for r in RECIPE_NAMES}}
    out: dict[str, Any] = {"config": vars(cfg) | {"batch": batch, "steps": steps}, "runs": []}
    for seed in range(seeds):
        for label, fp8 in modes.items():
            torch.manual_seed(seed)
            model = GPT(cfg).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=lr)
            model, opt = mixprec.initialize(model, opt, mixprec.Recipe("O2", BF16, fp8=fp8))
            run = torch.compile(model) if compile_it else model
            data = markov(device, cfg.vocab_size, batch, cfg.block_size, 100 + seed)
            losses = []
            for _ in range(steps):
                x, y = next(data)
                loss = F.cross_entropy(run(x).float().reshape(-1, cfg.vocab_size), y.reshape(-1))
                opt.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            out["runs"].append({"seed": seed, "mode": label, "losses": losses})
    for r in out["runs"]:
        r["final"] = sum(r["losses"][-20:]) / 20
        ref = next(b for b in out["runs"] if b["seed"] == r["seed"] and b["mode"] == "bf16 O2")
        r["vs_bf16"] = r["final"] / ref["final"] - 1
    return out


def curves_table(part: dict) -> str:
    c = part["config"]
    lines = [
        f"(c) loss after {c['steps']} steps (mean of the last 20), GPT {c['n_layer']} x "
        f"{c['n_embd']}, batch {c['batch']} x {c['block_size']}, Markov-chain tokens",
        "| seed | mode | final loss | vs bf16 O2 |",
        "|---|---|---|---|",
    ]
    for r in part["runs"]:
        lines.append(f"| {r['seed']} | {r['mode']} | {r['final']:.4f} | {r['vs_bf16']:+.3%} |")
    gaps = [abs(r["vs_bf16"]) for r in part["runs"] if r["mode"] != "bf16 O2"]
    finals = [r["final"] for r in part["runs"] if r["mode"] == "bf16 O2"]
    if gaps:
        lines.append(f"largest |FP8 - bf16| / bf16: {max(gaps):.3%}")
    if len(finals) > 1:
        lines.append(f"bf16 O2 across seeds: {min(finals):.4f} - {max(finals):.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="FP8 on CPU is emulated")
            _main(argv)
    finally:
        torch.set_num_threads(threads)  # a caller (a test) gets its threads back


def _main(argv: list[str] | None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--parts", nargs="+", default=["gemm", "step", "curves"])
    p.add_argument("--rounds", type=int, default=None, help="default 5; quick 3")
    p.add_argument("--steps", type=int, default=None, help="timed steps per round (step part)")
    p.add_argument("--curve-steps", type=int, default=None, help="default 500 GPU, 300 CPU")
    p.add_argument("--seeds", type=int, default=None, help="curve seeds (default 1 GPU, 3 CPU)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    p.add_argument("--json", help="write the results here (after each part)")
    p.add_argument("--markdown", help="write the header and tables here (after each part)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="the step part alone, for " + ", ".join(QUICK_STEP) + " (3 rounds)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes: the code path only")
    p.add_argument(
        "--budget-s",
        type=float,
        default=0,
        help="start no part after this many seconds (0: no limit); a skipped part is named",
    )
    args = p.parse_args(argv)
    SMOKE[0] = args.smoke
    if args.quick:
        args.parts = ["step"]
    rounds = args.rounds or (3 if args.quick else 5)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible here; use --device cpu.")
    if not cuda:
        torch.set_num_threads(args.threads)
    doc: dict[str, Any] = {
        "machine": machine(args.device),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
    }
    print(f"bench_fp8: {doc['machine']}")
    tables = []
    start = time.perf_counter()
    for part in args.parts:
        t0 = time.perf_counter()
        if args.budget_s and t0 - start > args.budget_s:
            doc.setdefault("skipped", []).append(part)
            print(f"skipped part {part!r} ({t0 - start:.0f} s used): run it with --parts {part}")
            continue
        if part == "gemm":
            sizes = [1024, 2048, 4096, 8192, 16384] if cuda else [128, 256, 512]
            shapes = (
                [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 2048, 8192)]
                if cuda
                else [(1024, 256, 256)]
            )
            if args.smoke:
                sizes, shapes = [32, 64], [(64, 64, 64)]
            doc.update(gemm_part(args.device, sizes, rounds if cuda else 3, shapes))
            tables.append(gemm_tables(doc))
        elif part == "step":
            steps = args.steps or (5 if cuda else 1)
            labels = QUICK_STEP if args.quick else ()
            deadline = start + args.budget_s if args.budget_s else 0
            doc.update(step_part(args.device, rounds, steps, cuda, labels, deadline))
            tables.append(step_table(doc))
        elif part == "curves":
            steps = args.curve_steps or (5 if args.smoke else 500 if cuda else 300)
            seeds = args.seeds or (1 if cuda or args.smoke else 3)
            doc["curves"] = curves_part(args.device, steps, seeds, cuda)
            tables.append(curves_table(doc["curves"]))
        else:
            raise SystemExit(f"unknown part {part!r}; expected gemm, step or curves")
        print(tables[-1])
        print(f"({part}: {time.perf_counter() - t0:.0f} s)\n", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(f"{doc['date']} · {doc['machine']} · torch {doc['torch']}\n\n")
                f.write("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()
