"""Data-parallel mixed-precision training with DDP and a bf16 gradient all-reduce.

    torchrun --standalone --nproc_per_node=2 examples/torchrun_ddp.py [--steps 30]

gloo on CPU, nccl when CUDA is available. Trains a small GPT on a toy counting language,
checkpoints at the end and prints the loss, the loss scale and the bytes on the wire.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mixprec
import mixprec.distributed as mpd
from mixprec.bench.models import GPT, GPTConfig


def batch(step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = (
        torch.randint(0, 32, (n, 1), generator=g)
        + torch.randint(1, 4, (n, 1), generator=g) * torch.arange(33)
    ) % 32
    return seq[:, :-1], seq[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--checkpoint", default="ddp_checkpoint.pt")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=32, n_layer=2, n_head=2, n_embd=64)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # 1. mixprec first (casts parameters, builds fp32 masters) ...
    model, opt = mixprec.initialize(model, opt, "O2", torch.bfloat16)
    # 2. ... then DDP: bf16 all-reduce, every rank skips the same steps.
    model = mpd.wrap_ddp(model, opt, device_ids=[device.index] if cuda else None)

    for step in range(args.steps):
        idx, tgt = (t[rank::world].to(device) for t in batch(step))
        logits = model(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        opt.backward(loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if rank == 0 and step % 10 == 0:
            print(
                f"step {step:3d}  loss {loss.item():.3f}  scale {opt.loss_scale:g}  "
                f"skipped {opt.skipped_steps}"
            )
    mpd.assert_in_sync(opt)
    mpd.save_checkpoint(args.checkpoint, model, opt)
    hook = model.mixprec_comm_hook
    if rank == 0:
        print(
            f"final loss {loss.item():.3f}; all-reduced {hook.wire_bytes / args.steps:,.0f} "
            f"bytes/step in {sorted(map(str, hook.wire_dtypes))} "
            f"(fp32 would be {hook.elements * 4 / args.steps:,.0f}); "
            f"checkpoint: {args.checkpoint}"
        )
    # model and optimizer are cyclic garbage holding gloo objects: freed here, with every rank
    # past its work, not at interpreter exit (where a rank could abort with "terminate called
    # without an active exception")
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
