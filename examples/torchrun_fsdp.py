"""Sharded training with FSDP2 under a mixprec recipe: train, save, resume, export.

    torchrun --standalone --nproc_per_node=2 examples/torchrun_fsdp.py --steps 20
    torchrun --standalone --nproc_per_node=2 examples/torchrun_fsdp.py --steps 40 --resume

The first run trains 20 steps of the ``"lean"`` recipe (16-bit weights stepped with stochastic
rounding, 8-bit optimizer states, each rank holding its shards) and saves a
torch.distributed.checkpoint directory: every rank writes its own shards. The second loads it and
trains on to step 40, the run it resumes repeated bit for bit. Each run ends by exporting a plain
fp32 state dict from rank 0, which loads into the model built without mixprec. ``--recipe O2``
(fp32 shards as the master weights) works the same way. gloo on CPU, nccl when CUDA is available.

The same plain fp32 state dict, bit for bit, comes from the saved directory offline (one
process, no process group, no model prepared by mixprec)::

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save("fsdp_checkpoint", "fsdp_checkpoint.pt")  # torch's own: shards joined
    state = mixprec.distributed.fp32_state_dict_from_checkpoint("fsdp_checkpoint.pt")
    GPT(CONFIG).load_state_dict(state)  # == torch.load("fsdp_checkpoint_fp32.pt")
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mixprec.distributed as mpd
from mixprec.bench.models import GPT, Block, GPTConfig

CONFIG = GPTConfig(vocab_size=32, block_size=32, n_layer=2, n_head=2, n_embd=64)


def batch(step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = (
        torch.randint(0, 32, (n, 1), generator=g)
        + torch.randint(1, 4, (n, 1), generator=g) * torch.arange(33)
    ) % 32
    return seq[:, :-1], seq[:, 1:]


def lm_loss(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def export(model: torch.nn.Module, opt, path: str, rank: int) -> None:
    """A plain fp32 state dict (a collective: every rank calls it), saved by rank 0 and checked
    by loading it into the model built without mixprec."""
    full = mpd.fp32_full_state_dict(model, opt)
    if rank == 0:
        torch.save(full, path)
        plain = GPT(CONFIG)
        plain.load_state_dict(torch.load(path, weights_only=True))
        idx, tgt = batch(10_000)
        with torch.no_grad():
            print(f"plain fp32 model from {path}: loss {lm_loss(plain(idx), tgt).item():.4f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20, help="train up to this step")
    ap.add_argument("--recipe", default="lean")
    ap.add_argument("--checkpoint", default="fsdp_checkpoint")
    ap.add_argument("--resume", action="store_true", help="load --checkpoint first")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model = GPT(CONFIG).to(device)
    # Shards each Block (and the root), casts as the recipe says, builds the optimizer on the
    # shards, then prepares mixprec's engine, update mode and loss scaling.
    model, opt = mpd.initialize_fsdp(
        model, lambda ps: torch.optim.AdamW(ps, lr=3e-3), args.recipe, torch.bfloat16, units=Block
    )
    progress = Path(args.checkpoint, "progress.json")
    start = 0
    if args.resume:
        mpd.load_checkpoint(args.checkpoint, model, opt)  # every rank reads its shards
        start = json.loads(progress.read_text())["step"]
    for step in range(start, args.steps):
        idx, tgt = (t[rank::world].to(device) for t in batch(step))
        loss = lm_loss(model(idx), tgt)
        opt.backward(loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item()!r}  skipped {opt.skipped_steps}")
    mpd.save_checkpoint(args.checkpoint, model, opt)  # every rank writes its shards
    if rank == 0:
        progress.write_text(json.dumps({"step": args.steps}))
    export(model, opt, args.checkpoint + "_fp32.pt", rank)
    # model and optimizer are cyclic garbage holding gloo objects: freed here, with every rank
    # past its work, not at interpreter exit (where a rank could abort with "terminate called
    # without an active exception")
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
