"""Memory per rank under FSDP2: bytes of training state per parameter per rank, measured.

    python benchmarks/bench_fsdp_memory.py                       # fp32, O2, lean on 1, 2, 4 ranks
    python benchmarks/bench_fsdp_memory.py --modes lean --ranks 2 --json out.json
    python benchmarks/bench_fsdp_memory.py --meta     # the model built on the meta device
    python benchmarks/bench_fsdp_memory.py --warm     # the runtime read after a tiny warm-up step

For each (mode, ranks) a fresh ``torchrun --standalone --nproc_per_node=R`` (gloo, one thread per
rank) runs :func:`rank_child` in every rank: imports and ``init_process_group`` (the runtime:
resident set after them), bench_state's 50.4 M MLP (48 x Linear(1024, 1024) + GELU),
``mixprec.distributed.initialize_fsdp(model, AdamW(lr=1e-4), recipe, bf16, units=nn.Linear)``
and ``--steps`` AdamW steps at batch 2 per rank. Modes: ``fp32`` is mixprec's recipe ``"O0"``
under ``initialize_fsdp`` (fp32 FSDP2: fp32 shards, fp32 all-gather and reduce-scatter, torch's
AdamW on the shards); ``O2`` (fp32 master shards, bf16 all-gather and reduce-scatter) and
``lean`` (bf16 shards stepped with 8-bit states). Two figures per rank, both divided by that
rank's share of the parameters (parameters / R):

* ``peak``: the whole process's ``VmHWM`` minus the runtime -- it includes building the full,
  unsharded fp32 model on every rank before ``fully_shard`` (4 B per model parameter, i.e.
  4 x R bytes per sharded parameter), unless ``--meta`` builds it under
  ``torch.device("meta")`` and ``initialize_fsdp`` fills each rank's shards module by module;
* ``train``: ``VmHWM`` reset (``/proc/self/clear_refs``) after ``initialize_fsdp``, read after
  the steps, minus the runtime: the training state alone (shards, gradients, optimizer states,
  one unit's gathered weights and the activations, < 1 %).

``--warm`` reads the runtime after one step of a tiny model (2 x Linear(64, 64)) under the same
recipe and ``initialize_fsdp``, freed before the real model is built: what any first step
allocates once whatever the model's size (gloo's buffers, autograd's engine, kernels and the C
update's library loaded, lazy registrations) then counts as runtime, not as training state.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile

import torch
from bench_memory import _rss
from bench_overhead import machine
from bench_state import _loss, make_model
from torch import nn

MODES = {"fp32": "O0", "O2": "O2", "lean": "lean"}
#: bytes each rank must hold per parameter of its shard during training: fp32: weight, gradient,
#: m, v (4 + 4 + 4 + 4); O2: fp32 master shard + fp32 gradient + m + v (FSDP2's bf16 copy is the
#: transient all-gather); lean: bf16 weight + bf16 gradient + 8-bit m and v (with their scales)
EXPECTED = {"fp32": 16.0, "O2": 16.0, "lean": 2 + 2 + 2 * 1.016}


def _reset_peak() -> bool:
    """Reset this process's VmHWM to its current resident set (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _warm_up(mode: str) -> None:
    """One step of a tiny model under ``mode`` and ``initialize_fsdp``, then freed."""
    import gc

    import mixprec.distributed as mpd

    tiny = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    tiny, opt = mpd.initialize_fsdp(
        tiny,
        lambda ps: torch.optim.AdamW(ps, lr=1e-4),
        MODES[mode],
        None if mode == "fp32" else torch.bfloat16,
        units=nn.Linear,
    )
    opt.backward(tiny(torch.randn(2, 64)).float().pow(2).mean())
    opt.step()
    opt.zero_grad(set_to_none=True)
    del tiny, opt
    gc.collect()


def rank_child(
    mode: str, steps: int = 3, scale: float = 1.0, meta: bool = False, warm: bool = False
) -> dict:
    """One rank: runtime, model, ``initialize_fsdp``, ``steps`` steps; its bytes per parameter.

    Joins the process group torchrun's environment names (``MASTER_ADDR``, ``RANK``, ...)."""
    import torch._dynamo  # every torch optimizer imports it when built
    import torch.distributed as dist
    import torch.distributed.fsdp  # runtime, not state

    import mixprec  # noqa: F401
    import mixprec.distributed as mpd

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if warm:
            _warm_up(mode)
        runtime = _rss("VmRSS")
        with torch.device("meta") if meta else contextlib.nullcontext():
            model, batch = make_model("mlp", scale)
        params = sum(p.numel() for p in model.parameters())
        model, opt = mpd.initialize_fsdp(
            model,
            lambda ps: torch.optim.AdamW(ps, lr=1e-4),
            MODES[mode],
            None if mode == "fp32" else torch.bfloat16,  # O0 refuses a 16-bit dtype
            units=nn.Linear,
        )
        built = _rss("VmHWM") - runtime
        reset = _reset_peak()
        torch.manual_seed(rank)
        for _ in range(steps):
            x, y = batch()
            loss = _loss("mlp", model(x), y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
        hwm = _rss("VmHWM")
        peak = max(hwm - runtime, built)
        share = params / world
        return dict(
            mode=mode,
            meta=meta,
            warm=warm,
            ranks=world,
            rank=rank,
            params=params,
            runtime_mib=runtime / 2**20,
            peak_mib=peak / 2**20,
            peak_bytes_per_param=peak / share,
            train_mib=(hwm - runtime) / 2**20 if reset else None,
            train_bytes_per_param=(hwm - runtime) / share if reset else None,
            loss=float(loss),
        )
    finally:
        if own:
            dist.destroy_process_group()


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def measure(
    modes: list[str],
    ranks: list[int],
    steps: int,
    scale: float,
    mmap: int | None = None,
    meta: bool = False,
    warm: bool = False,
) -> list[dict]:
    """Every (mode, R) in a fresh torchrun; one row per (mode, R): the worst rank's figures."""
    rows = []
    for mode in modes:
        for r in ranks:
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [
                    sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={r}", os.path.abspath(__file__), "--rank-child", mode,
                    "--steps", str(steps), "--scale", str(scale), "--out", tmp,
                ] + (["--meta"] if meta else []) + (["--warm"] if warm else [])  # fmt: skip
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                if mmap is not None:  # a fixed threshold: freed large blocks go back to the OS
                    env["MALLOC_MMAP_THRESHOLD_"] = str(mmap)
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
                if out.returncode:
                    raise RuntimeError(f"{mode} on {r} ranks failed:\n{out.stderr[-3000:]}")
                per_rank = [_read(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))]
            worst = max(per_rank, key=lambda d: d["peak_mib"])
            worst["train_mib"] = max(d["train_mib"] or 0 for d in per_rank) or None
            if worst["train_mib"] is not None:
                worst["train_bytes_per_param"] = worst["train_mib"] * 2**20 * r / worst["params"]
            rows.append(worst)
            print(
                f"  {mode} x{r}: peak {worst['peak_bytes_per_param']:.1f} B/param/rank "
                f"({worst['peak_mib']:.0f} MiB), train {worst['train_bytes_per_param'] or 0:.1f}",
                flush=True,
            )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| mode | built | ranks | expected state (B/param/rank) | measured, training "
        "(B/param/rank) | training MiB/rank | whole-process peak (B/param/rank) | peak MiB/rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        train, mib = r["train_bytes_per_param"], r["train_mib"]
        lines.append(
            f"| {r['mode']} | {'meta' if r.get('meta') else 'whole'}"
            f"{', warm' if r.get('warm') else ''} | {r['ranks']} | "
            f"{EXPECTED[r['mode']]:.1f} | "
            f"{'-' if train is None else f'{train:.1f}'} | "
            f"{'-' if mib is None else f'{mib:.0f}'} | "
            f"{r['peak_bytes_per_param']:.1f} | {r['peak_mib']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--scale", type=float, default=1.0, help="shrink the model (< 1)")
    p.add_argument("--mmap-threshold", type=int, metavar="BYTES",
                   help="glibc's MALLOC_MMAP_THRESHOLD_ for the ranks")  # fmt: skip
    p.add_argument("--meta", action="store_true", help="build the model on the meta device")
    p.add_argument("--warm", action="store_true", help="read the runtime after a tiny step")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--rank-child", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_child:
        res = rank_child(args.rank_child, args.steps, args.scale, args.meta, args.warm)
        with open(os.path.join(args.out, f"rank{res['rank']}.json"), "w") as f:
            json.dump(res, f)
        return
    rows = measure(
        args.modes, args.ranks, args.steps, args.scale, args.mmap_threshold, args.meta, args.warm
    )
    mmap = "" if args.mmap_threshold is None else f" · MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}"
    print(
        f"\n{datetime.date.today()} · {machine('cpu')} · torch {torch.__version__} · gloo, "
        f"1 thread per rank · {rows[0]['params'] / 1e6:.1f} M parameters · {args.steps} steps"
        f"{mmap}\n"
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
