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
likewise, ``lean`` with 4-bit states, and ``lean-fp32-compute``, storage-only precision:
``lean``'s tensors with the forward and backward in fp32); and
``torchao-adamw8bit`` (bf16 weights, torchao's 8-bit AdamW) when torchao is installed. The
header names the machine and torch. Any mode with ``+fused`` appended (``fp32+fused``,
``O3+fused``) is that mode with the user's ``AdamW(params, lr, fused=True)`` instead of the
plain ``AdamW(params, lr)``.

    python benchmarks/bench_state.py --models mlp --race 5 \\
        --modes fp32+fused fp32 O2 O2+fused O3 O3+fused lean lean+fused

``--loops`` measures each mode (default :data:`LOOP_MODES`) per step in the loop shapes users
have (:data:`LOOPS`, a fresh process each): ``plain`` (forward, backward, step, zero_grad),
``clip`` (``clip_grad_norm_(model.parameters(), 1.0)`` before every step, as nanoGPT, HF
Trainer and Lightning do) and ``clip-accum`` (two micro-batches per step, each loss divided by
2 and ``loss.backward()``-ed as nanoGPT does, then the clip and the step). The high-water mark
is reset before every step (``5`` written to ``/proc/self/clear_refs``) and read after it, so
each step's own peak is reported: step 1, the max of the later steps and the max of the first
four, beside the total of the recipe's own :meth:`mixprec.Recipe.table` (mixprec modes) and
the gap between the two; ``after trim`` is the resident set after the last step once glibc's
``malloc_trim`` has handed the heap's free pages back (freed temporaries the heap kept are in
the peaks, not in it). ``bf16-weights`` is the model cast to bf16 with torch's optimizer and
no mixprec; ``torchao-adamw8bit`` uses ``bf16_stochastic_round=True`` where torchao has it.

    python benchmarks/bench_state.py --loops --models mlp --json results_state_loops.json
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
    "lean-coded": "lean gradients=coded",  # gradients as 8-bit codes from backward to step
    "lean-4bit-coded": "lean optimizer_states=4-bit gradients=coded",
    # storage-only precision: lean's tensors, the forward and backward in fp32 (each layer's
    # bf16 weights widened for its own forward and again for its backward, one at a time)
    "lean-fp32-compute": "lean compute=fp32",
}
MODES = ("fp32", "torch-autocast", *RECIPES, "torchao-adamw8bit")
#: modes accepted but not run by default: the model cast to bf16, torch's optimizer, no mixprec
EXTRA_MODES = ("bf16-weights",)
#: ``--loops``: loop shapes, and the modes measured in them by default
LOOPS = ("plain", "clip", "clip-accum")
LOOP_MODES = ("fp32+fused", "bf16-weights+fused", "torchao-adamw8bit", "O3", "lean", "lean-4bit")
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
    "lean-fp32-compute": 2 * (2 + 2 * 1.016) + 2,
    "lean-4bit": 2 * (2 + 2 * 0.516) + 2,
    "lean-4bit-nearest": 2 * (2 + 2 * 0.516) + 2,
}
#: modes whose update runs inside the backward (released gradients): their update time is
#: backward + step, an upper bound (the gradient's computation is in it)
RELEASED = ("lean", "lean-4bit", "lean-4bit-nearest", "lean-fp32-compute")
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
    """torchao's optimizer and ``bf16-weights`` step a bf16 model with no mixprec boundary:
    bf16 inputs."""
    bf16_model = mode.removesuffix(FUSED) in ("torchao-adamw8bit", "bf16-weights")
    return x.to(BF16) if bf16_model and x.is_floating_point() else x


def _loss(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "mlp":
        return nn.functional.mse_loss(out.float(), target)
    return nn.functional.cross_entropy(out.float().flatten(0, 1), target.flatten())


def _torchao_rounding() -> dict[str, bool]:
    """``bf16_stochastic_round=True`` where this torchao's AdamW8bit has it, else nothing."""
    import inspect

    from torchao.optim import AdamW8bit

    has = "bf16_stochastic_round" in inspect.signature(AdamW8bit).parameters
    return {"bf16_stochastic_round": True} if has else {}


def _prepare(mode: str, model: nn.Module, stochastic: bool = False) -> tuple[nn.Module, Any, Any]:
    """(model, optimizer, region) of ``mode``; the optimizer has ``backward`` for mixprec.
    ``stochastic``: torchao's bf16 update rounds stochastically where it can (``--loops``)."""
    import mixprec

    fused = mode.endswith(FUSED)
    mode = mode.removesuffix(FUSED)
    if mode == "torchao-adamw8bit":
        from torchao.optim import AdamW8bit

        model = model.to(BF16)
        rounding = _torchao_rounding() if stochastic else {}
        return model, AdamW8bit(model.parameters(), lr=1e-3, **rounding), None
    if mode == "bf16-weights":
        model = model.to(BF16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if fused else {}))
    if mode in ("fp32", "torch-autocast", "bf16-weights"):
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
    """Seconds spent in mixprec's C update loops (:func:`c_loop.run`, wrapped while the
    race runs): the update alone of a mode whose update runs inside the backward."""

    def __init__(self) -> None:
        from mixprec._core.update import c_loop

        self.module, self.real, self.seconds = c_loop, c_loop.run, 0.0

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


#: bytes the probe of :func:`_peak_resets` allocates, frees, then expects the mark to drop by
_PROBE = 64 << 20


def _peak_resets() -> bool:
    """Whether this kernel resets ``VmHWM`` on a write of "5" to ``/proc/self/clear_refs``: a
    64 MiB buffer (mmapped, so handed back when freed) is touched and freed, and the mark must
    drop by at least half of it when reset."""
    probe = torch.ones(_PROBE // 4)
    del probe
    before = _rss("VmHWM")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _rss("VmHWM") < before - _PROBE // 2


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _trimmed_rss() -> int:
    """The resident set after glibc's ``malloc_trim(0)`` hands the heap's free pages back:
    what the process still holds once freed temporaries are gone (the plain RSS where there is
    no glibc)."""
    import ctypes

    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None).malloc_trim(0)
    return _rss("VmRSS")


def _is_mixprec(mode: str) -> bool:
    return mode.removesuffix(FUSED) in RECIPES


def recipe_total(mode: str) -> float | None:
    """The total bytes per parameter that ``mixprec.Recipe(line, bf16).table()`` states for a
    mixprec mode (AdamW: 2 states), as printed; None for the others."""
    import re

    import mixprec

    if not _is_mixprec(mode):
        return None
    text = mixprec.Recipe(RECIPES[mode.removesuffix(FUSED)], BF16).table()
    found = re.search(r"^\s*total\s+([0-9.]+) B/param$", text, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"No total in the table of {mode}:\n{text}")
    return float(found.group(1))


def recipe_loop_total(mode: str, loop: str) -> float | None:
    """What ``mixprec.Recipe(line, bf16).loop_bytes()`` states for ``loop`` (:data:`LOOPS`;
    the plain loop's first step included), rounded as the table prints it; None for modes that
    are not mixprec's."""
    import mixprec

    if not _is_mixprec(mode):
        return None
    stated = mixprec.Recipe(RECIPES[mode.removesuffix(FUSED)], BF16).loop_bytes()
    key = {"plain": "plain", "clip": "clip", "clip-accum": "accumulate"}[loop]
    value = max(stated["plain"], stated["first_step"]) if key == "plain" else stated[key]
    return round(value, 1)


def child_loop(name: str, mode: str, loop: str, steps: int, scale: float) -> dict[str, Any]:
    """``mode`` in the loop shape ``loop`` (:data:`LOOPS`) in this process: per step, the peak
    resident set during that step (the mark reset before it) minus the runtime, and the resident
    set after it. Where the kernel refuses the reset, the peaks are cumulative (``per_step``
    False). ``clip-accum`` calls ``loss.backward()`` as nanoGPT does; the other loops call
    ``opt.backward(loss)`` for mixprec modes, as :func:`child` does."""
    import torch._dynamo  # every torch optimizer imports it when built

    import mixprec  # noqa: F401  its import is runtime, not state

    if mode == "torchao-adamw8bit":
        import torchao.optim  # noqa: F401  likewise runtime

    per_step = _peak_resets()
    runtime = _rss("VmRSS")
    model, batch = make_model(name, scale)
    params = sum(p.numel() for p in model.parameters())
    model, opt, region = _prepare(mode, model, stochastic=True)
    micro = 2 if loop == "clip-accum" else 1
    plain_backward = loop == "clip-accum" or not hasattr(opt, "backward")
    peaks, after, times = [], [], []
    for _ in range(steps):
        if per_step:
            _reset_peak()
        t0 = time.perf_counter()
        for _ in range(micro):
            x, y = batch()
            x = _inputs(mode, x)
            with region if region is not None else contextlib.nullcontext():
                loss = _loss(name, model(x), y) / micro
            if plain_backward:
                loss.backward()
            else:
                opt.backward(loss)
        if loop != "plain":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        peaks.append(_rss("VmHWM") - runtime)
        after.append(_rss("VmRSS") - runtime)
    extra = {"trimmed_bytes": _trimmed_rss() - runtime}
    if mode == "torchao-adamw8bit":
        extra["torchao_options"] = _torchao_rounding()
    return dict(
        model=name,
        mode=mode,
        loop=loop,
        backward="loss.backward()" if plain_backward else "opt.backward(loss)",
        params=params,
        per_step=per_step,
        runtime_bytes=runtime,
        peak_bytes=peaks,
        after_bytes=after,
        step_s=times,
        loss=float(loss.detach()) * micro,
        **extra,
    )


def _loop_row(raw: dict[str, Any]) -> dict[str, Any]:
    """The summary of one :func:`child_loop`: bytes per parameter (2 decimals) of step 1, the
    max of the later steps and the max of the first four; what the recipe's table states for
    that loop and the gap (max_1_4 - table) for mixprec modes."""
    bpp = [b / raw["params"] for b in raw["peak_bytes"]]
    max_1_4 = round(max(bpp[:4]), 2)
    total = recipe_loop_total(raw["mode"], raw["loop"])
    return dict(
        model=raw["model"],
        mode=raw["mode"],
        loop=raw["loop"],
        backward=raw["backward"],
        params=raw["params"],
        step_1=round(bpp[0], 2),
        steps_2_on_max=round(max(bpp[1:]), 2) if len(bpp) > 1 else None,
        max_1_4=max_1_4,
        table=total,
        gap=None if total is None else round(max_1_4 - total, 2),
        after_trim=round(raw["trimmed_bytes"] / raw["params"], 2),
        per_step_bytes_per_param=[round(b, 2) for b in bpp],
        after_step_bytes_per_param=[round(b / raw["params"], 2) for b in raw["after_bytes"]],
        **{k: v for k, v in raw.items() if k not in ("model", "mode", "loop", "backward",
                                                     "params")},
    )  # fmt: skip


def measure_loops(
    models: list[str], modes: list[str], steps: int, scale: float
) -> tuple[list[dict], list[str]]:
    """(rows, notes) of ``--loops``: every mode x loop in a fresh process, one at a time."""
    rows, notes = [], []
    for name in models:
        for mode in modes:
            if mode.removesuffix(FUSED) == "torchao-adamw8bit" and not _has_torchao():
                notes.append(f"{name} {mode}: skipped (import torchao fails)")
                print(f"  {notes[-1]}", flush=True)
                continue
            for loop in LOOPS:
                cmd = [sys.executable, __file__, "--child-loop", name, mode, loop]
                cmd += ["--steps", str(steps), "--scale", str(scale)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if out.returncode:
                    raise RuntimeError(f"{name} {mode} {loop} failed:\n{out.stderr[-3000:]}")
                rows.append(_loop_row(json.loads(out.stdout.strip().splitlines()[-1])))
                r = rows[-1]
                print(f"  {name} {mode} {loop}: step 1 {r['step_1']:.2f}, "
                      f"max_1_4 {r['max_1_4']:.2f} B/param", flush=True)  # fmt: skip
    if rows and not all(r["per_step"] for r in rows):
        notes.append(
            "the kernel refused to reset VmHWM (/proc/self/clear_refs): the figures after step "
            "1 are cumulative peaks, not each step's own"
        )
    return rows, notes


def loop_table(rows: list[dict], steps: int) -> str:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = [
        f"| model | mode | loop | backward | step 1 | steps 2-{steps} max | max_1_4 | table "
        "| gap | after trim |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['mode']} | {r['loop']} | {r['backward']} | {f(r['step_1'])} | "
        f"{f(r['steps_2_on_max'])} | {f(r['max_1_4'])} | {f(r['table'])} | {f(r['gap'])} | "
        f"{f(r['after_trim'])} |"
        for r in rows
    ]
    return "\n".join(lines)


def _has_torchao() -> bool:
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return False
    done = subprocess.run([sys.executable, "-c", "import torchao.optim"], capture_output=True,
                          check=False)  # fmt: skip
    return done.returncode == 0


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    known = (*MODES, *EXTRA_MODES)
    p.add_argument("--modes", nargs="+", help="default: every mode (--loops: LOOP_MODES)",
                   choices=[*known, *(m + FUSED for m in known)])  # fmt: skip
    p.add_argument("--steps", type=int, help="training steps (default 3; --loops: 6)")
    p.add_argument("--scale", type=float, default=1.0, help="shrink the models (< 1)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--race", type=int, metavar="ROUNDS",
                   help="instead: step times of --modes, one process, rounds")  # fmt: skip
    p.add_argument("--loops", action="store_true",
                   help="instead: per-step bytes of --modes in each of LOOPS")  # fmt: skip
    p.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--child-loop", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.steps is None:
        args.steps = 6 if args.loops or args.child_loop else 3
    if args.modes is None:
        args.modes = list(LOOP_MODES if args.loops else MODES)
    if args.child_loop:
        print(json.dumps(child_loop(*args.child_loop, args.steps, args.scale)))
        return
    if args.loops:
        loops_main(args)
        return
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


def loops_main(args: argparse.Namespace) -> None:
    if args.steps < 2:
        raise SystemExit("--loops needs --steps 2 or more (step 1 and the steps after it)")
    rows, notes = measure_loops(args.models, args.modes, args.steps, args.scale)
    header = dict(
        date=str(datetime.date.today()),
        machine=machine("cpu"),
        torch=torch.__version__,
        command=" ".join(["python benchmarks/bench_state.py", *args.argv]),
        steps=args.steps,
        scale=args.scale,
        loops=list(LOOPS),
        measure=(
            "per step: VmHWM reset before the step (5 to /proc/self/clear_refs), VmHWM after "
            "it (forward(s), backward(s), clip, step, zero_grad) minus the RSS after the "
            "imports, / parameters; a fresh process per mode and loop"
        ),
        notes=notes,
    )
    print(
        f"\n{header['date']} · {header['machine']} · torch {header['torch']} · bf16 · "
        f"{args.steps} steps, a fresh process per mode and loop, the peak reset before each step"
        f"{'' if all(r['per_step'] for r in rows) else ' (refused: cumulative peaks)'}\n"
    )
    print(loop_table(rows, args.steps))
    for note in notes:
        print(f"\nNote: {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**header, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
