"""Bytes per parameter of the training state: weights, masters, gradients, optimizer states.

    python benchmarks/bench_state.py                            # both models, every mode
    python benchmarks/bench_state.py --models mlp --modes O2 O3 --json out.json

Each mode runs in a fresh Python process: imports, model, AdamW (lr 1e-3), ``--steps`` training
steps. The figure is the process's resident-set high-water mark (``VmHWM``) after the steps,
minus the resident set after the imports (the runtime), divided by the parameter count.
Activations are kept small on purpose, so the figure is the training state:

* ``mlp``: 48 x (Linear 1024 x 1024 + GELU), 50.4 M parameters, batch 2 (< 1 MB of activations);
* ``gpt``: a GPT of 113 M parameters (16 layers, width 768, context 256), batch 1.

The step column is the median step time in that process (the first step excluded); for ratios
of step times, ``--race ROUNDS`` runs ``--modes`` in one process, one step each per round, and
reports each update's bandwidth against a copy and its first step's extra time (see
:func:`race`). Modes:
``fp32`` and ``torch-autocast`` (bf16) with torch's AdamW; the mixprec recipes of
:data:`RECIPES` in bf16 (``O2``; ``O3`` with its default Kahan update; ``O3-update-none``, the
optimizer's own bf16 step; ``O3-kahan-8bit``; ``lean``, ``lean`` with its gradients held until
the step or released from the first step on, ``lean-clip``: ``lean`` in a loop that clips by
global norm before every step, which holds them, ``lean-accum``: two backward passes per step,
likewise, and ``lean`` with 4-bit states); and
``torchao-adamw8bit`` (bf16 weights, torchao's 8-bit AdamW) when torchao is installed. The
header names the machine and torch. Any mode with ``+fused`` appended (``fp32+fused``,
``O3+fused``) is that mode with the user's ``AdamW(params, lr, fused=True)`` instead of the
plain ``AdamW(params, lr)``.

    python benchmarks/bench_state.py --models mlp --race 5 \\
        --modes fp32+fused fp32 O2 O2+fused O3 O3+fused lean lean+fused
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from bench_memory import _rss
from bench_overhead import machine
from torch import nn

MODELS = ("mlp", "gpt")
#: mixprec modes: name -> recipe line (bf16 is given to initialize)
RECIPES = {
    "O2": "O2",
    "O3": "O3",
    "O3-update-none": "O3 update=none",
    "O3-kahan-8bit": "O3 update=kahan optimizer_states=8-bit",
    "lean": "lean",
    "lean-held": "lean gradients=held",
    "lean-released": "lean gradients=released",
    "lean-clip": "lean",  # "auto" in a loop that clips every step: held from the first step
    "lean-accum": "lean",  # "auto" accumulating 2 micro-batches per step: held likewise
    "lean-accum-plain": "lean",  # the same with loss.backward(), as nanoGPT calls it
    "lean-held-accum": "lean gradients=held",  # accumulating, held as asked
    "lean-4bit": "lean optimizer_states=4-bit",
    "lean-4bit-nearest": "lean optimizer_states=4-bit update=nearest",
}
MODES = ("fp32", "torch-autocast", *RECIPES, "torchao-adamw8bit")
#: modes whose loop clips the gradients by global norm (1.0) before every step
CLIPS = ("lean-clip",)
#: micro-batches (backward passes) per step; 1 where not named
MICRO = {"lean-accum": 2, "lean-accum-plain": 2, "lean-held-accum": 2}
#: modes whose loop calls loss.backward() rather than opt.backward(loss)
PLAIN = ("lean-accum-plain",)
#: a mode name ending in this is that mode with the user's ``AdamW(..., fused=True)``
FUSED = "+fused"
#: least bytes an update must move per parameter (``--race``'s bandwidth): it reads the
#: gradient once and reads and writes the weight, compensation and states once each
UPDATE_BYTES = {
    "fp32": 2 * (4 + 8) + 4,  # fp32 weight, two fp32 moments; fp32 gradient
    "O2": 2 * (4 + 8) + 4,  # the fp32 master's update (the bf16 copy-back not counted)
    "O3": 2 * (2 + 2 + 2 + 4) + 2,  # bf16 weight + Kahan compensation, bf16 m, fp32 v
    "O3-kahan-8bit": 2 * (2 + 2 + 2 * 1.016) + 2,
    "lean": 2 * (2 + 2 * 1.016) + 2,  # bf16 weight (stochastic), 8-bit m and v
    "lean-held": 2 * (2 + 2 * 1.016) + 2,
    "lean-4bit": 2 * (2 + 2 * 0.516) + 2,
    "lean-4bit-nearest": 2 * (2 + 2 * 0.516) + 2,
}
#: modes whose update runs inside the backward (released gradients): their update time is
#: backward + step, an upper bound (the gradient's computation is in it)
RELEASED = ("lean", "lean-4bit", "lean-4bit-nearest")
BF16 = torch.bfloat16


def make_model(name: str, scale: float = 1.0) -> tuple[nn.Module, Any]:
    """(model, batch maker) of ``name``; ``scale`` < 1 shrinks it (for a quick check)."""
    torch.manual_seed(0)
    if name == "mlp":
        width, depth = max(int(1024 * scale), 16), max(int(48 * scale), 2)
        layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())]
        model = nn.Sequential(*layers)
        return model, lambda: (torch.randn(2, width), torch.randn(2, width))
    from mixprec.bench.models import GPT, GPTConfig

    width = max(int(768 * scale) // 12 * 12, 24)
    cfg = GPTConfig(vocab_size=96, block_size=256, n_layer=max(int(16 * scale), 1), n_head=12,
                    n_embd=width)  # fmt: skip
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (1, cfg.block_size + 1))
    return model, lambda: (idx[:, :-1], idx[:, 1:])


def _inputs(mode: str, x: torch.Tensor) -> torch.Tensor:
    """torchao's optimizer steps a bf16 model with no mixprec boundary: bf16 inputs."""
    return x.to(BF16) if mode == "torchao-adamw8bit" and x.is_floating_point() else x


def _loss(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "mlp":
        return nn.functional.mse_loss(out.float(), target)
    return nn.functional.cross_entropy(out.float().flatten(0, 1), target.flatten())


def _prepare(mode: str, model: nn.Module) -> tuple[nn.Module, Any, Any]:
    """(model, optimizer, region) of ``mode``; the optimizer has ``backward`` for mixprec."""
    import mixprec

    fused = mode.endswith(FUSED)
    mode = mode.removesuffix(FUSED)
    if mode == "torchao-adamw8bit":
        from torchao.optim import AdamW8bit

        model = model.to(BF16)
        return model, AdamW8bit(model.parameters(), lr=1e-3), None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if fused else {}))
    if mode in ("fp32", "torch-autocast"):
        region = torch.autocast("cpu", BF16) if mode == "torch-autocast" else None
        return model, opt, region
    model, opt = mixprec.initialize(model, opt, RECIPES[mode], BF16)
    return model, opt, None


def _backward(mode: str, opt: Any, loss: torch.Tensor) -> None:
    if hasattr(opt, "backward") and mode not in PLAIN:
        opt.backward(loss)
    else:
        loss.backward()


def child(name: str, mode: str, steps: int, scale: float) -> dict[str, Any]:
    """One mode in this process: bytes per parameter of the added peak, and the step time."""
    import torch._dynamo  # every torch optimizer imports it when built

    import mixprec  # noqa: F401  its import is runtime, not state

    runtime = _rss("VmRSS")
    model, batch = make_model(name, scale)
    params = sum(p.numel() for p in model.parameters())
    model, opt, region = _prepare(mode, model)
    times = []
    for _ in range(steps):
        x, y = batch()
        x = _inputs(mode, x)
        t0 = time.perf_counter()
        for _ in range(MICRO.get(mode, 1)):
            if region is not None:
                with region:
                    loss = _loss(name, model(x), y)
            else:
                loss = _loss(name, model(x), y)
            _backward(mode, opt, loss)
        if mode in CLIPS:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    added = _rss("VmHWM") - runtime
    return dict(
        model=name,
        mode=mode,
        params=params,
        bytes_per_param=added / params,
        step_ms=statistics.median(times[1:] or times) * 1e3,
        loss=float(loss),
    )


class _KernelClock:
    """Seconds spent in mixprec's C update loops (:func:`cpu_kernels.run`, wrapped while the
    race runs): the update alone of a mode whose update runs inside the backward."""

    def __init__(self) -> None:
        from mixprec._core.update import cpu_kernels

        self.module, self.real, self.seconds = cpu_kernels, cpu_kernels.run, 0.0

    def __enter__(self) -> _KernelClock:
        def timed(*args: Any) -> None:
            t0 = time.perf_counter()
            self.real(*args)
            self.seconds += time.perf_counter() - t0

        self.module.run = timed
        return self

    def __exit__(self, *exc: object) -> None:
        self.module.run = self.real


def _rounds(runs, rounds, name, times, updates, copies, loops, clock, src, dst) -> None:
    """``race``'s rounds: a copy, then one step of every mode; times appended in place."""
    for _ in range(rounds + 2):  # the first two rounds (states, then compile) are not counted
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
        for mode, (model, opt, region, batch) in runs.items():
            torch.manual_seed(0)
            x, y = batch()
            x = _inputs(mode, x)
            t0, c0 = time.perf_counter(), clock.seconds
            for _ in range(MICRO.get(mode, 1)):
                with region if region is not None else contextlib.nullcontext():
                    loss = _loss(name, model(x), y)
                t1 = time.perf_counter()  # the last backward's start
                _backward(mode, opt, loss)
            t2 = time.perf_counter()
            if mode in CLIPS:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            t3 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            times[mode].append(time.perf_counter() - t0)
            base = mode.removesuffix(FUSED)
            updates[mode].append(t3 - (t1 if base in RELEASED else t2))
            loops[mode].append(clock.seconds - c0)


def race(name: str, modes: list[str], rounds: int, scale: float) -> dict[str, float]:
    """Step times of ``modes`` in this process, interleaved: each round times one step of every
    mode (the same batch), so the ratios compare modes that saw the same machine at the same
    moment. Returns the median step (ms) per mode and the median per-round ratio to the first,
    and per mode its update's achieved bandwidth -- :data:`UPDATE_BYTES` x parameters / the
    median ``step()`` time (backward + step for :data:`RELEASED` modes) -- as a fraction of a
    large fp32 copy timed in the same rounds (read + write), the first two steps' extra time over
    the median step (state creation, then the compile of a fused update, which needs the
    states), and the seconds the fused update's first calls took (its compile). For modes stepped
    by mixprec's C loops, ``C-loop bw`` is the same rate over the loops' own time (without the
    backward, the finite check and the Python around them)."""
    runs = {}
    for mode in modes:
        model, batch = make_model(name, scale)
        runs[mode] = (*_prepare(mode, model), batch)
    params = sum(p.numel() for p in make_model(name, scale)[0].parameters())
    src = torch.randn(max(params, 2**26))
    dst = torch.empty_like(src)
    times: dict[str, list[float]] = {m: [] for m in modes}
    updates: dict[str, list[float]] = {m: [] for m in modes}
    copies: list[float] = []
    loops: dict[str, list[float]] = {m: [] for m in modes}
    with _KernelClock() as clock:
        _rounds(runs, rounds, name, times, updates, copies, loops, clock, src, dst)
    first = modes[0]
    out = {f"{m} ms": statistics.median(times[m][2:]) * 1e3 for m in modes}
    for m in modes[1:]:
        ratios = [a / b for a, b in zip(times[m][2:], times[first][2:])]
        out[f"{m} / {first}"] = statistics.median(ratios)
    copy_rate = 2 * src.nbytes / statistics.median(copies[2:])
    out["copy GB/s"] = copy_rate / 1e9
    for m in modes:
        nbytes = UPDATE_BYTES.get(m.removesuffix(FUSED))
        if nbytes is not None:
            rate = nbytes * params / statistics.median(updates[m][2:])
            out[f"{m} bw"] = rate / copy_rate
            if statistics.median(loops[m][2:]) > 0:
                loop_rate = nbytes * params / statistics.median(loops[m][2:])
                out[f"{m} C-loop bw"] = loop_rate / copy_rate
        out[f"{m} first two+ s"] = sum(times[m][:2]) - 2 * statistics.median(times[m][2:])
        fused = getattr(getattr(runs[m][1], "lean", None), "fused", None)
        if fused is not None:
            out[f"{m} compile s"] = getattr(fused, "compile_seconds", 0.0)
    return out


def measure(models: list[str], modes: list[str], steps: int, scale: float) -> list[dict]:
    rows = []
    for name in models:
        for mode in modes:
            if mode == "torchao-adamw8bit" and not _has_torchao():
                print(f"  {name} {mode}: skipped (torchao is not installed)", flush=True)
                continue
            cmd = [sys.executable, __file__, "--child", name, mode, "--steps", str(steps)]
            out = subprocess.run(
                [*cmd, "--scale", str(scale)], capture_output=True, text=True, check=False
            )
            if out.returncode:
                raise RuntimeError(f"{name} {mode} failed:\n{out.stderr[-3000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  {name} {mode}: {rows[-1]['bytes_per_param']:.1f} B/param", flush=True)
    return rows


def _has_torchao() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def table(rows: list[dict]) -> str:
    lines = [
        "| model | mode | parameters | bytes per parameter | step (ms) |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['mode']} | {r['params'] / 1e6:.1f} M | "
        f"{r['bytes_per_param']:.1f} | {r['step_ms']:.0f} |"
        for r in rows
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--modes", nargs="+", default=list(MODES),
                   choices=[*MODES, *(m + FUSED for m in MODES)])  # fmt: skip
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--scale", type=float, default=1.0, help="shrink the models (< 1)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--race", type=int, metavar="ROUNDS",
                   help="instead: step times of --modes, one process, rounds")  # fmt: skip
    p.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.steps, args.scale)))
        return
    if args.race:
        for name in args.models:
            res = race(name, args.modes, args.race, args.scale)
            print(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
        return
    rows = measure(args.models, args.modes, args.steps, args.scale)
    print(
        f"\n{datetime.date.today()} · {machine('cpu')} · torch {torch.__version__} · bf16 · "
        f"{args.steps} steps, a fresh process per mode\n"
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
