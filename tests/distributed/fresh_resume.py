"""``dcp_resume``'s FSDP2 resume in fresh processes, by hand (the suite rebuilds in the same).

    for phase in full save load; do
        OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 \\
            tests/distributed/fresh_resume.py --dir /tmp/fresh $phase
    done

``full``: 7 uninterrupted steps per recipe (O2, O3 Kahan, "lean", "lean" 4-bit), results kept;
``save``: 4 steps and ``save_checkpoint``, then the processes exit; ``load``: new processes
build the model from another seed, ``load_checkpoint``, 3 steps (an inf on rank 1 alone at the
second), and print per rank whether losses, weights and state shards equal the full run's bit
for bit and which steps were skipped. Same data and model as ``scenarios.py``'s ``dcp_resume``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scenarios as S

import mixprec.distributed as mpd

RECIPES = ("O2", "kahan", "lean", "lean_4bit")


def _steps(model, opt, steps: range) -> tuple[list[float], list[bool]]:
    losses, skipped = [], []
    for step in steps:
        x, y = S.dcp_batch(step)
        loss = S.mse(model, S.local(x), S.local(y))
        opt.backward(loss)
        if step == 5:
            S.poison_local_grad(opt, inject=S.RANK == 1)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        skipped.append(opt.step_skipped)
    return losses, skipped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("phase", choices=("full", "save", "load"))
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    S.RANK, S.WORLD = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    out = {}
    for name in RECIPES:
        recipe, path = S.DCP_RECIPES[name], str(root / f"ckpt_{name}")
        mine = root / f"{{}}_{name}_{S.RANK}.pt"
        if args.phase == "full":
            torch.save(S._dcp_run(recipe, 7, None, path, poison_at=5), str(mine).format("full"))
            continue
        model, opt = S._dcp_build(recipe, 0 if args.phase == "save" else 7)
        if args.phase == "save":
            losses, _ = _steps(model, opt, range(4))
            mpd.save_checkpoint(path, model, opt)
            torch.save(losses, str(mine).format("first"))
            continue
        mpd.load_checkpoint(path, model, opt)
        losses, skipped = _steps(model, opt, range(4, 7))
        full = torch.load(str(mine).format("full"), weights_only=False)
        first = torch.load(str(mine).format("first"))
        weights = S.flat(
            (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float()
            for v in model.parameters()
        )
        out[name] = {
            "losses_equal": full["losses"] == first + losses,
            "weights_bitwise": S.bitwise_equal(full["weights"], weights),
            "state_bitwise": S.bitwise_equal(full["local_state"], S._local_state(model, opt)),
            "skipped": skipped,
            "skipped_full": full["skipped"][4:],
        }
    if args.phase == "load":
        print(f"rank {S.RANK}: {json.dumps(out)}", flush=True)
    S.shutdown()


if __name__ == "__main__":
    main()
