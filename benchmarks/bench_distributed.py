"""Distributed benchmark: bytes all-reduced per step (fp32 vs 16-bit) and 2-rank step time.

    python benchmarks/bench_distributed.py [--rounds 5] [--steps 4] [--nproc 2]

Re-launches itself under ``torch.distributed.run`` (gloo on CPU). Every mode is built once and
timed in interleaved rounds (each round times every mode in turn); the table shows medians and
the median of per-round ratios against the fp32 DDP baseline, because host noise here is large.
Workload: the GPT of mixprec.bench.models at width 128, 2 layers, context 64, global batch 16.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch


def _launch(argv: list[str], nproc: int) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        os.path.abspath(__file__),
        *argv,
    ]
    return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _run(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    import mixprec
    import mixprec.distributed as mpd
    from mixprec.bench.models import GPT, Block, GPTConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, n_embd=128)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 96, (16, 65), generator=g)[rank::world]
    idx, tgt = data[:, :-1], data[:, 1:]

    def ddp(level, dtype, wire):
        torch.manual_seed(0)
        m = GPT(cfg)
        m, o = mixprec.initialize(m, torch.optim.AdamW(m.parameters(), lr=1e-3), level, dtype)
        return mpd.wrap_ddp(m, o, comm_dtype=wire), o

    def fsdp():
        torch.manual_seed(0)
        return mpd.initialize_fsdp(
            GPT(cfg),
            lambda ps: torch.optim.AdamW(ps, lr=1e-3),
            level="O2",
            dtype=torch.bfloat16,
            units=Block,
        )

    modes = {
        "DDP fp32 (O0), fp32 wire": ddp("O0", None, torch.float32),
        "DDP O1 bf16, fp32 wire": ddp("O1", torch.bfloat16, torch.float32),
        "DDP O1 bf16, bf16 wire": ddp("O1", torch.bfloat16, torch.bfloat16),
        "DDP O2 bf16, bf16 wire": ddp("O2", torch.bfloat16, torch.bfloat16),
        "FSDP2 O2 bf16 (reduce bf16)": fsdp(),
    }

    def step(model, opt):
        logits = model(idx)
        opt.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1)))
        opt.step()
        opt.zero_grad()

    for model, opt in modes.values():  # warm-up
        step(model, opt)
        hook = getattr(model, "mixprec_comm_hook", None)
        if hook is not None:
            hook.reset_stats()
    times: dict[str, list[float]] = {k: [] for k in modes}
    for _ in range(args.rounds):
        for name, (model, _opt) in modes.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(model, opt)
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / args.steps)
    if rank != 0:
        dist.destroy_process_group()
        return
    base = "DDP fp32 (O0), fp32 wire"
    n_steps = args.rounds * args.steps
    print(
        f"torch {torch.__version__}, {world} ranks (gloo, CPU, 1 thread each), "
        f"{args.rounds} rounds x {args.steps} steps"
    )
    print("| mode | all-reduce bytes/step/rank | wire dtype | median step (s) | vs fp32 DDP |")
    print("|---|---|---|---|---|")
    lines = {}
    for name, (model, _opt) in modes.items():
        hook = getattr(model, "mixprec_comm_hook", None)
        if hook is not None:
            wire = f"{hook.wire_bytes / n_steps:,.0f}"
            dtypes = ", ".join(sorted(str(d).replace("torch.", "") for d in hook.wire_dtypes))
        else:
            wire, dtypes = "(reduce-scatter)", "bf16 + fp32 norms"
        ratio = statistics.median(b / t for b, t in zip(times[base], times[name]))
        lines[name] = (wire, statistics.median(times[name]))
        print(
            f"| {name} | {wire} | {dtypes} | {statistics.median(times[name]):.4f} | {ratio:.2f}x |"
        )
    f32, b16 = lines["DDP O1 bf16, fp32 wire"], lines["DDP O1 bf16, bf16 wire"]
    print(
        f"\nbytes all-reduced per step: fp32 {f32[0]} vs bf16 {b16[0]} per rank; "
        f"step time ({world} ranks): fp32 DDP {lines[base][1]:.3f} s, "
        f"O2 bf16 + bf16 wire {lines['DDP O2 bf16, bf16 wire'][1]:.3f} s"
    )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    if "RANK" not in os.environ:
        sys.exit(_launch(sys.argv[1:], args.nproc))
    _run(args)


if __name__ == "__main__":
    main()
