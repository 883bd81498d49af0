"""The ``mixprec`` command: ``demo`` (the main job), ``bench``, ``check`` and ``report``.

Ctrl-C ends any command with one line on stderr and exit status 130 (as a shell reports a
SIGINT), never a traceback; ``bench`` writes its JSON after every workload, so what finished
is kept.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from mixprec import __version__
from mixprec._initialize import level_name
from mixprec.bench.runner import MODES
from mixprec.cli.demo import MIN_STEPS, SLOW_WIDTH
from mixprec.numerics import report as report_cli

__all__ = ["main"]

_WORKLOADS = ("seed-mlp", "mnist1d-cnn", "char-gpt")


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
        table.add_column(h, justify="left" if h == "mode" else "right", no_wrap=True)
    for r in rows:
        table.add_row(*r)
    console = Console()
    if not console.is_terminal:  # logs and pipes: do not squeeze the table into 80 columns
        console = Console(width=120)
    console.print(table)


def _demo(args: argparse.Namespace) -> int:
    from mixprec._core.hardware import check
    from mixprec.cli import demo

    report = check("cpu", verbose=False)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.dtype]
    chosen = demo.pick_dtype(report, dtype)
    fast = report.is_fast(chosen)
    width = args.width or (4096 if fast else demo.SLOW_WIDTH)
    print(
        f"mixprec demo: the Keras guide's MLP on MNIST-1D (generated locally), {args.steps} "
        f"rounds (each gives every mode one step, in turn), batch {args.batch}, on "
        f"{report.name} [{' '.join(report.features) or 'no AVX512/AMX flags'}] with torch "
        f"{torch.__version__}"
    )
    if not fast:
        print(
            f"{chosen} is not fast on this CPU ({report.dtypes[str(chosen)[6:]].reason}); "
            f"to keep the run short the MLP is {width} wide (not 4096) and the rounds stop "
            f"once a 16-bit level has trained {args.budget:g} s (every mode runs the same "
            "steps), to show their memory and accuracy. What such a CPU gets instead runs in "
            f"the same rounds: storage-only precision, Recipe('lean', {chosen}, "
            "compute='fp32') (16-bit weights and optimizer states, fp32 matmuls)."
        )
    results = demo.run_demo(
        steps=args.steps,
        levels=tuple(args.levels),
        batch=args.batch,
        seed=args.seed,
        progress=not args.no_progress,
        dtype=chosen,
        budget=args.budget,
        width=width,
    )
    _print_table(demo.HEADERS, demo.format_results(results), "fp32 vs mixed precision")
    print(demo.NOTE)
    print(demo.verdict(results, report, chosen))
    return 0


QUICK_SLOW_BUDGET = 4.0  # --quick where 16-bit is slow: seconds of training per mode
QUICK_SLOW_GPT_BATCH = 4  # --quick where 16-bit is slow: char-gpt's batch (not 16)


def _narrow(wl: object, width: int, quick: bool) -> object:
    """The workload with a narrower model, where 16-bit matmuls are emulated (~80x slower)."""
    import dataclasses

    from mixprec.bench.models import GPT, GPTConfig, SeedMLP

    if wl.name == "seed-mlp":
        return dataclasses.replace(
            wl,
            make_model=lambda data: SeedMLP(data["x"].shape[1], width, 10),
            description=wl.description.replace("4096-4096", f"{width}-{width}"),
        )
    if wl.name == "char-gpt":
        batch = QUICK_SLOW_GPT_BATCH if quick else wl.batch_size
        return dataclasses.replace(
            wl,
            make_model=lambda data: GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128)),
            batch_size=batch,
            description=wl.description.replace("4x384", "2x128") + f", batch {batch}",
        )
    return wl


def _bench(args: argparse.Namespace) -> int:
    import pathlib

    from mixprec._core.hardware import check
    from mixprec.bench import report

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    command = "mixprec bench " + " ".join(args.argv)
    hw = check("cpu", verbose=False)
    time_budget = args.time_budget
    slow = not hw.is_fast(dtype)
    if slow:
        time_budget = _slow_bench(hw, dtype, time_budget, args.quick)
    out = pathlib.Path(args.out)
    path = pathlib.Path(args.json) if args.json else out / "results.json"
    info = report.meta(command, dtype, args.seed, args.quick)
    results: dict = {}
    saved = 0
    name = None
    try:
        for name in args.workloads:
            wl = _bench_workload(name, args, slow)
            modes = _train_modes(wl, name, args, dtype, time_budget, slow)
            results[name] = (wl, modes)
            unit = "accuracy" if wl.metric == "accuracy" else "val loss"
            _print_table(
                report.HEADERS,
                report.rows(wl, modes),
                f"{name}: {wl.description} ({unit}, target {wl.target})",
            )
            print(report.NOTE)
            if not args.no_plots:
                for plot in report.write_plots(wl, modes, out):
                    print(f"wrote {plot}")
            report.write_json(report.to_json(info, results), path)
            saved = len(results)
            print(f"wrote {path} ({saved} of {len(args.workloads)} workloads)")
    except KeyboardInterrupt:
        if results and saved < len(results):
            report.write_json(report.to_json(info, results), path)
        what = (
            f"{path} holds the finished workload(s): {', '.join(results)}"
            if results
            else "no workload finished, nothing written"
        )
        print(f"mixprec bench: interrupted during {name}; {what}.", file=sys.stderr)
        return 130
    return 0


def _slow_bench(hw: object, dtype: torch.dtype, time_budget: float | None, quick: bool) -> float:
    """Where ``dtype`` is slow here: say how the run is shortened (and silence the per-call
    performance warning, said once here); returns the time budget per mode."""
    import warnings

    from mixprec._core.hardware import MixprecPerformanceWarning

    support = hw.dtypes.get(str(dtype)[6:])
    time_budget = time_budget or (QUICK_SLOW_BUDGET if quick else 60.0)
    gpt = f"2x128, batch {QUICK_SLOW_GPT_BATCH}" if quick else "2x128"
    print(
        f"{dtype} is not fast on {hw.name} ({support.reason if support else 'unknown'}): "
        f"each mode trains for at most {time_budget:g} s (at least {MIN_STEPS} steps), "
        f"evaluates once at the end, and the seed MLP is {SLOW_WIDTH} wide (not 4096) and "
        f"the GPT {gpt} (not 4x384), so the 16-bit modes show their memory and per-step "
        "cost here, not their speed on a GPU or a bf16 CPU."
    )
    warnings.simplefilter("ignore", MixprecPerformanceWarning)  # said once, above
    return time_budget


def _bench_workload(name: str, args: argparse.Namespace, slow: bool) -> object:
    """The named workload as the options ask: a larger MNIST-1D set, a narrower model."""
    import dataclasses

    from mixprec.bench.workloads import WORKLOADS, make_large_mnist1d

    wl = WORKLOADS[name]
    if args.mnist1d_samples and name in ("seed-mlp", "mnist1d-cnn"):
        n = args.mnist1d_samples  # a larger generated set for timing (80/20 split)
        wl = dataclasses.replace(wl, prepare=lambda quick, seed, n=n: make_large_mnist1d(n))
    if slow:
        wl = _narrow(wl, SLOW_WIDTH, args.quick)
    return wl


def _train_modes(
    wl: object,
    name: str,
    args: argparse.Namespace,
    dtype: torch.dtype,
    time_budget: float | None,
    slow: bool,
) -> object:
    """Every ``--modes`` mode trained on ``wl``, with a progress bar per mode."""
    from mixprec.bench import runner
    from mixprec.cli.progress import make_progress

    steps = args.steps or (wl.quick_steps if args.quick else wl.steps)
    with make_progress(not args.no_progress) as ui:
        tasks = {m: ui.add(f"{name} {m}", steps) for m in args.modes}
        return runner.run_workload(
            wl,
            list(args.modes),
            dtype=dtype,
            batch_size=args.batch_size,
            steps=steps,
            time_budget=time_budget,
            min_steps=MIN_STEPS if slow else 1,
            quick=args.quick,
            seed=args.seed,
            eval_every=steps if slow else None,
            memory=not args.no_memory,
            max_batch_mb=args.max_batch,
            on_step=lambda m, step, loss, tasks=tasks: ui.advance(tasks[m]),
        )


def _check(args: argparse.Namespace) -> int:
    from mixprec._core.hardware import check

    check(args.device, verbose=True)
    return 0


def _threads_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch CPU threads (default: one per core, fewer while other jobs hold cores)",
    )


def _choose_threads(requested: int | None) -> int:
    """``--threads``, else torch's count, lowered to the cores other jobs leave free (said).

    torch's threads meet at a barrier after every parallel op. While another job holds a core,
    each op waits for a thread the scheduler has put aside: on 2 cores with two other jobs
    running, small steps measured 10-100x slower with 2 threads than with 1, and which mode won
    changed from run to run. The 1-minute load average tells how many cores are taken.
    """
    if requested is not None:
        return requested
    threads = torch.get_num_threads()
    cores = os.cpu_count() or threads
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        return threads
    free = max(1, int(cores - load + 0.5))
    if free < threads:
        print(
            f"note: this host is busy (load average {load:.1f} on {cores} cores), so torch runs "
            f"on {free} of its {threads} threads: threads that wait on each other behind other "
            "jobs make steps many times slower and timings noisy (--threads N to choose)."
        )
        return free
    return threads


def _level(text: str) -> str:
    """A ``--levels`` value: a level name in any case ("o2" is "O2")."""
    try:
        return level_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _mode(text: str) -> str:
    """A ``--modes`` value: a mode name in any case ("o2" is "O2")."""
    return next((m for m in MODES if m.lower() == text.lower()), text)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `mixprec`: what it can do, not a usage error
        parser.print_help()
        return 0
    args.argv = list(sys.argv[1:] if argv is None else argv)[1:]
    _check_args(parser, args)
    threads = torch.get_num_threads()
    try:
        if args.command in ("demo", "bench"):
            torch.set_num_threads(_choose_threads(args.threads))
        return args.run(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback, the shell's exit status
        print(f"mixprec {args.command}: interrupted.", file=sys.stderr)
        return 130
    finally:
        torch.set_num_threads(threads)  # main() may run inside a longer process (tests)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixprec", description="Automatic mixed precision for PyTorch."
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"mixprec {__version__} (torch {torch.__version__})",
    )
    sub = parser.add_subparsers(dest="command")
    _add_demo(sub)
    _add_bench(sub)
    c = sub.add_parser("check", help="which 16-bit dtypes are supported and fast here")
    c.add_argument("--device", default=None)
    c.set_defaults(run=_check)
    __import__("mixprec.inference.bench", fromlist=["add_parser"]).add_parser(sub)
    report_cli.add_parser(sub)
    return parser


def _add_demo(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="train a model in fp32 and mixed precision, side by side")
    d.add_argument("--steps", type=int, default=60, help="training steps per mode (default 60)")
    d.add_argument("--batch", type=int, default=512)
    d.add_argument(
        "--width",
        type=int,
        default=None,
        help=f"the MLP's hidden width (default 4096, or {SLOW_WIDTH} where 16-bit is slow)",
    )
    d.add_argument(
        "--levels",
        nargs="+",
        default=["O0", "O1", "O2"],
        type=_level,
        choices=["O0", "O1", "O2", "O3"],
        help="O0 is the fp32 baseline; put it first",
    )
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--dtype",
        choices=["bf16", "fp16"],
        default=None,
        help="16-bit dtype (default: the fast one here, per `mixprec check`)",
    )
    d.add_argument(
        "--budget",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="where the 16-bit dtype is slow here, stop the rounds once a 16-bit level has "
        "trained this long (default 20)",
    )
    d.add_argument("--no-progress", action="store_true")
    _threads_option(d)
    d.set_defaults(run=_demo)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="time-to-accuracy benchmarks: every mode, one run")
    b.add_argument(
        "workloads",
        nargs="*",
        metavar="WORKLOAD",
        help=f"one or more of {', '.join(_WORKLOADS)} (default: all)",
    )
    b.add_argument(
        "--modes",
        nargs="+",
        default=["fp32", "torch-autocast", "O1", "O2", "O3"],
        type=_mode,
        choices=list(MODES),
    )
    b.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    b.add_argument("--batch-size", type=int, default=None)
    b.add_argument("--steps", type=int, default=None, help="training steps per mode")
    b.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="stop a mode once its training time exceeds this many seconds",
    )
    b.add_argument("--seed", type=int, default=0)
    b.add_argument(
        "--quick",
        action="store_true",
        help="small data and few steps: a smoke run of a minute or two on 2 cores",
    )
    b.add_argument(
        "--max-batch",
        type=float,
        default=None,
        metavar="MB",
        help="also find the largest batch (default x 2^k) whose step fits in MB",
    )
    b.add_argument(
        "--mnist1d-samples",
        type=int,
        default=None,
        metavar="N",
        help="time the MNIST-1D workloads on a larger generated set of N samples "
        "(80/20 split) instead of the standard 4000/1000 one",
    )
    b.add_argument("--out", default="bench_out", help="folder for plots and results.json")
    b.add_argument("--json", default=None, help="results file (default OUT/results.json)")
    b.add_argument("--no-plots", action="store_true")
    b.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    b.add_argument("--no-progress", action="store_true")
    _threads_option(b)
    b.set_defaults(run=_bench)


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot say: ``parser.error`` (exit status 2) on a bad combination."""
    if args.command == "demo" and (
        args.levels[0] != "O0" or len(set(args.levels)) < len(args.levels)
    ):
        parser.error(
            "--levels must start with O0 (the fp32 baseline every ratio is against) and name "
            f"each level once; received {args.levels}."
        )
    if args.command == "bench":
        unknown = [w for w in args.workloads if w not in _WORKLOADS]
        if unknown:
            parser.error(f"unknown workload(s) {unknown}: choose from {list(_WORKLOADS)}.")
        args.workloads = args.workloads or list(_WORKLOADS)
    if args.command == "demo" and args.steps < 3:
        parser.error(f"--steps must be at least 3, received {args.steps}.")
    for name in ("steps", "batch_size", "mnist1d_samples", "width", "batch", "threads"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} must be a positive integer, received {value}.")
    for name in ("time_budget", "max_batch", "budget"):
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, received {value}.")


if __name__ == "__main__":
    sys.exit(main())
