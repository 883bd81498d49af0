"""The ``mixprec`` command: ``mixprec demo`` (the main job) and ``mixprec check``."""

from __future__ import annotations

import argparse
import sys

import torch

__all__ = ["main"]


def _print_table(headers: list[str], rows: list[list[str]], title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        print(title)
        for line in [headers, ["-" * w for w in widths], *rows]:
            print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
        return
    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="left" if h == "mode" else "right")
    for r in rows:
        table.add_row(*r)
    Console().print(table)


def _demo(args: argparse.Namespace) -> int:
    from mixprec import demo
    from mixprec.hardware import check

    report = check(verbose=False)
    print(f"mixprec demo: the Keras guide's MLP on MNIST-1D (generated locally), {args.steps} "
          f"steps per mode, batch {args.batch}, on {report.name} with torch {torch.__version__}")
    results = demo.run_demo(steps=args.steps, levels=tuple(args.levels), batch=args.batch,
                            seed=args.seed, progress=not args.no_progress)
    _print_table(demo.HEADERS, demo.format_results(results), "fp32 vs mixed precision")
    best = min(results[1:], key=lambda r: r.median_step, default=None)
    if best is not None:
        base = results[0]
        print(f"{best.mode} steps are {base.median_step / best.median_step:.2f}x faster than "
              f"fp32; test accuracy {best.accuracy:.1%} vs {base.accuracy:.1%}.")
    return 0


def _check(args: argparse.Namespace) -> int:
    from mixprec.hardware import check

    check(args.device, verbose=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mixprec", description="Automatic mixed precision "
                                     "for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a model in fp32 and mixed precision, side by side")
    d.add_argument("--steps", type=int, default=60, help="training steps per mode (default 60)")
    d.add_argument("--batch", type=int, default=512)
    d.add_argument("--levels", nargs="+", default=["O0", "O1", "O2"],
                   choices=["O0", "O1", "O2", "O3"], help="O0 is the fp32 baseline; put it first")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(run=_demo)
    c = sub.add_parser("check", help="which 16-bit dtypes are supported and fast here")
    c.add_argument("--device", default=None)
    c.set_defaults(run=_check)
    args = parser.parse_args(argv)
    if getattr(args, "steps", 3) < 3:
        parser.error(f"--steps must be at least 3, received {args.steps}.")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
