"""Time one training step (forward, backward, optimizer) in every mode, in one run.

    python benchmarks/bench_step.py                       # both workloads, all modes
    python benchmarks/bench_step.py --workloads gpt --rounds 9 --json out.json

Prints a Markdown table (median step time; speed-ups as ratios of those medians against fp32
and torch.autocast measured in the same rounds; peak memory) headed by date, CPU and torch
version, ready to paste into the README.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform

import torch

from mixprec._core.hardware import check
from mixprec.bench import steps as benchmarking


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--workloads",
        nargs="+",
        default=list(benchmarking.WORKLOADS),
        choices=list(benchmarking.WORKLOADS),
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=[m for m in benchmarking.MODES if not m.endswith("-O3")],
        choices=list(benchmarking.MODES),
    )
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    p.add_argument("--no-casts", action="store_true", help="skip the cast-counting pass")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    report = check(verbose=False)
    header = (
        f"{datetime.date.today()} · {report.name} · {torch.get_num_threads()} threads · "
        f"torch {torch.__version__} · python {platform.python_version()} · {args.dtype} · "
        f"{args.rounds} rounds"
    )
    results = benchmarking.run(
        args.workloads,
        args.modes,
        rounds=args.rounds,
        warmup=args.warmup,
        dtype=dtype,
        memory=not args.no_memory,
        casts=not args.no_casts,
    )
    print()
    print(header)
    print()
    print(benchmarking.format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "header": header,
                    "results": [{**dataclasses.asdict(r), "median": r.median} for r in results],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
