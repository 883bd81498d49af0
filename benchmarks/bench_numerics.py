"""Overhead of the numerics toolkit on the GPT workload: locator, op stats, both.

Every mode trains the same GPT (``mixprec.bench.models.GPT``, default config: 4 layers, width 384,
context 256) with AdamW under ``mixprec.autocast(bfloat16)``. Modes run in interleaved rounds
-- each round times every mode once, in turn -- and the overhead is the median of the
per-round ratios to the plain step (absolute times drift on this shared machine).

    python benchmarks/bench_numerics.py --rounds 7 --batch 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import mixprec
from mixprec.bench.models import GPT, GPTConfig

MODES = ("plain", "locator", "op_stats", "locator+op_stats")


def _region(mode: str, model: torch.nn.Module) -> contextlib.AbstractContextManager:
    stack = contextlib.ExitStack()
    if "locator" in mode:
        stack.enter_context(mixprec.numerics.locate_nonfinite(model))
    if "op_stats" in mode:
        stack.enter_context(mixprec.numerics.op_stats())
    return stack


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=2, help="timed steps per mode per round")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--json", default=None, help="also write the raw times here")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cfg = GPTConfig()
    models = {m: GPT(cfg) for m in MODES}
    for m in MODES[1:]:
        models[m].load_state_dict(models["plain"].state_dict())
    opts = {m: torch.optim.AdamW(models[m].parameters(), lr=3e-4) for m in MODES}
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size + 1))
    x, y = idx[:, :-1], idx[:, 1:]

    def step(mode: str) -> float:
        model, opt = models[mode], opts[mode]
        t0 = time.perf_counter()
        with _region(mode, model):
            with mixprec.autocast(torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
        return time.perf_counter() - t0

    for m in MODES:  # warm-up: first-call costs out of the timing
        step(m)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    ratios: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        this = {m: min(step(m) for _ in range(args.steps)) for m in order}
        for m in MODES:
            times[m].append(this[m])
            ratios[m].append(this[m] / this["plain"])
        print(
            f"round {r + 1}/{args.rounds}: " + ", ".join(f"{m} {this[m]:.3f}s" for m in MODES),
            file=sys.stderr,
        )
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "rounds": args.rounds,
        "command": "python benchmarks/bench_numerics.py " + " ".join(argv or sys.argv[1:]),
    }
    print(
        f"GPT (4 layers, width 384, context 256), batch {args.batch}, bf16 mixprec.autocast, "
        f"AdamW; {args.rounds} interleaved rounds, best of {args.steps} steps per round"
    )
    print("| mode | median step (s) | overhead vs plain (median of per-round ratios) |")
    print("|---|---|---|")
    for m in MODES:
        print(f"| {m} | {statistics.median(times[m]):.3f} | {statistics.median(ratios[m]):.3f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "times": times, "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
