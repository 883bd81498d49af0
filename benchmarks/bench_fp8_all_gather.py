"""FSDP2 weight all-gather bytes per step: tensorwise FP8 gathered in FP8 against in 16 bits.

    python benchmarks/bench_fp8_all_gather.py [--steps 5] [--nproc 2] [--json PATH]

Re-launches itself under ``torch.distributed.run`` (gloo on CPU). Each mode trains the GPT of
``bench_distributed.py`` (width 128, 2 layers, context 64, global batch 16; units: the blocks)
under ``initialize_fsdp`` with O2 bf16, FP8 on every block Linear (``layers="all"``), and counts
what reaches ``torch.distributed`` during forward and backward: the bytes every rank receives
from FSDP2's all-gathers (``all_gather_single``) and the bytes all-reduced (the FP8 gather's
amax all-reduces; the verdicts' all-reduce runs in ``step`` and is not counted). Losses are
printed to show the FP8 gather changes no number. No timings: FP8 GEMMs on a CPU are emulated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch


def _launch(argv: list[str], nproc: int) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", os.path.abspath(__file__), *argv]
    return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _run(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    import mixprec
    import mixprec.distributed as mpd
    from mixprec.bench.models import GPT, Block, GPTConfig
    from mixprec.fp8 import fp8_plan

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, n_embd=128)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 96, (16, 65), generator=g)[rank::world]
    idx, tgt = data[:, :-1], data[:, 1:]

    modes = {
        "O2 bf16, no FP8": None,
        "FP8 tensorwise, 16-bit gather": mixprec.FP8Config(layers="all", all_gather="16-bit"),
        "FP8 tensorwise, FP8 gather": mixprec.FP8Config(layers="all"),  # all_gather="auto"
        "FP8 rowwise (16-bit gather)": mixprec.FP8Config("rowwise", layers="all"),
    }
    rows = {}
    for name, fp8 in modes.items():
        torch.manual_seed(0)
        model, opt = mpd.initialize_fsdp(
            GPT(cfg),
            lambda ps: torch.optim.AdamW(ps, lr=1e-3),
            mixprec.Recipe("O2", torch.bfloat16, fp8=fp8),
            units=Block,
        )
        gathered, reduced, losses = [], [], []
        real_gather, real_reduce = dist.all_gather_single, dist.all_reduce

        def gather_spy(out, inp, *a, log=gathered, real=real_gather, **k):
            log[-1] += out.numel() * out.element_size()
            return real(out, inp, *a, **k)

        def reduce_spy(t, *a, log=reduced, real=real_reduce, **k):
            log[-1] += t.numel() * t.element_size()
            return real(t, *a, **k)

        for _ in range(args.steps):
            gathered.append(0)
            reduced.append(0)
            dist.all_gather_single, dist.all_reduce = gather_spy, reduce_spy
            try:
                logits = model(idx)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
                opt.backward(loss)
            finally:
                dist.all_gather_single, dist.all_reduce = real_gather, real_reduce
            opt.step()
            opt.zero_grad()
            lv = loss.detach().float().clone()
            dist.all_reduce(lv)
            losses.append(lv.item() / world)
        chosen = fp8_plan(model).chosen if fp8 is not None else []
        rows[name] = {
            "all_gather_bytes_per_step": gathered,
            "all_reduce_bytes_per_step": reduced,
            "fp8_layer_weight_elements": sum(model.get_submodule(n).weight.numel() for n in chosen),
            "losses": losses,
        }
    if rank == 0:
        _report(rows, args)
    dist.destroy_process_group()


def _report(rows: dict, args: argparse.Namespace) -> None:
    base = rows["FP8 tensorwise, 16-bit gather"]["all_gather_bytes_per_step"][-1]
    ref = rows["FP8 tensorwise, 16-bit gather"]["losses"]
    world = torch.distributed.get_world_size()
    print(f"torch {torch.__version__}, {world} gloo ranks, {args.steps} steps")
    print(
        "| mode | all-gather bytes / step (per rank) | vs FP8 with 16-bit gather "
        "| all-reduce bytes / step | FP8 weight elements | last loss | losses = 16-bit gather's |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        b = r["all_gather_bytes_per_step"]
        same = "bit for bit" if r["losses"] == ref else "no"
        print(
            f"| {name} | {b[-1]:,}{'' if len(set(b)) == 1 else f' (first {b[0]:,})'} "
            f"| {b[-1] / base:.3f}x | {r['all_reduce_bytes_per_step'][-1]:,} "
            f"| {r['fp8_layer_weight_elements']:,} | {r['losses'][-1]:.6f} | {same} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "nproc": world, "modes": rows}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the measurements here (rank 0)")
    args = ap.parse_args()
    if "LOCAL_RANK" not in os.environ:
        argv = ["--steps", str(args.steps)]  # torchrun would read --nproc as its own
        if args.json:
            argv += ["--json", os.path.abspath(args.json)]
        sys.exit(_launch(argv, args.nproc))
    _run(args)


if __name__ == "__main__":
    main()
