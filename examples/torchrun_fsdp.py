"""Sharded mixed-precision training with FSDP2: bf16 compute and reduce-scatter, fp32 shards.

    torchrun --standalone --nproc_per_node=2 examples/torchrun_fsdp.py [--steps 30]

gloo on CPU, nccl when CUDA is available. Saves a torch.distributed.checkpoint directory and
exports a plain fp32 state dict from rank 0.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mixprec.distributed as mpd
from mixprec.bench.models import GPT, Block, GPTConfig


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
    ap.add_argument("--checkpoint", default="fsdp_checkpoint")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=32, n_layer=2, n_head=2, n_embd=64)).to(device)
    # Shards (each Block its own unit), maps O2 onto MixedPrecisionPolicy, builds the optimizer
    # on the sharded fp32 parameters, then prepares mixprec's engine and loss scaling.
    model, opt = mpd.initialize_fsdp(
        model,
        lambda ps: torch.optim.AdamW(ps, lr=3e-3),
        "O2",
        torch.bfloat16,
        units=Block,
    )
    for step in range(args.steps):
        idx, tgt = (t[rank::world].to(device) for t in batch(step))
        logits = model(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        opt.backward(loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.3f}  skipped {opt.skipped_steps}")
    mpd.save_checkpoint(args.checkpoint, model, opt)  # every rank writes its shards
    full = mpd.fp32_full_state_dict(model)  # collective: all ranks call it
    if rank == 0:
        torch.save(full, args.checkpoint + "_fp32.pt")
        print(
            f"final loss {loss.item():.3f}; sharded checkpoint in {args.checkpoint}/, "
            f"fp32 export in {args.checkpoint}_fp32.pt"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
