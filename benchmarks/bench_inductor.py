"""Why is inductor slower than eager on this CPU? Time and profile the GPT step both ways.

    python benchmarks/bench_inductor.py [--rounds 5] [--batch 16]

Prints per-mode median step times (interleaved rounds, ratios to eager fp32) and, for each
mode, the profiler's top CPU ops for one step, so the time can be attributed (GEMMs, attention,
generated pointwise kernels, Python overhead).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mixprec.bench.models import GPT, GPTConfig


def make(mode: str, batch: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 96, (batch, 256), generator=g)
    y = torch.randint(0, 96, (batch, 256), generator=g)
    fwd = model
    if mode.startswith("inductor"):
        fwd = torch.compile(model)
    ctx = (lambda: torch.autocast("cpu", torch.bfloat16)) if "bf16" in mode else None

    def step() -> float:
        t = time.perf_counter()
        if ctx is None:
            out = fwd(x)
        else:
            with ctx():
                out = fwd(x)
        loss = F.cross_entropy(out.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument(
        "--modes", nargs="+", default=["eager-fp32", "inductor-fp32", "eager-bf16", "inductor-bf16"]
    )
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args()
    steps = {}
    for m in args.modes:
        t = time.perf_counter()
        steps[m] = make(m, args.batch)
        steps[m]()
        steps[m]()
        print(f"{m}: built and warmed up in {time.perf_counter() - t:.1f} s", flush=True)
    times = {m: [] for m in args.modes}
    for _ in range(args.rounds):
        for m in args.modes:
            times[m].append(steps[m]())
    base = args.modes[0]
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}")
    print("| mode | median step (s) | vs " + base + " |\n|---|---|---|")
    for m in args.modes:
        ratio = statistics.median(b / t for b, t in zip(times[base], times[m]))
        print(f"| {m} | {statistics.median(times[m]):.3f} | {ratio:.2f}x |")
    for m in args.modes:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            steps[m]()
        print(f"\n## {m}: top ops by self CPU time")
        print(
            prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60
            )
        )


if __name__ == "__main__":
    main()
