"""FSDP2 runs for test_fp8_gather.py beside it, under torchrun (gloo, CPU).

    torchrun --standalone --nproc_per_node=2 tests/distributed/fp8_gather.py --out DIR

A small GPT (the FP8 scenario's) on 2 ranks, O2 bf16 + tensorwise FP8 on every block Linear,
with the weights all-gathered in FP8 and in 16 bits (twice: the run-to-run spread), then a
rowwise run and a checkpoint resume. Every rank writes ``DIR/rank{r}.json``; the test asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import mixprec
import mixprec.distributed as mpd
from mixprec.bench.models import GPT, Block, GPTConfig
from mixprec.distributed.fp8_gather import gathered_in_fp8
from mixprec.fp8.gathered import GatheredFP8Weight
from mixprec.fp8.quantization import E4M3, quantize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scenarios import shutdown  # the launches' shared ending

BF16 = torch.bfloat16
SMALL = GPTConfig(vocab_size=32, block_size=32, n_layer=2, n_head=2, n_embd=64)
STEPS = 6
RANK = WORLD = 0


def tokens(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5000 + step)
    start = torch.randint(0, 32, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + stride * torch.arange(33)) % 32
    return seq[:, :-1][RANK::WORLD], seq[:, 1:][RANK::WORLD]


def loss_of(model, step: int) -> torch.Tensor:
    idx, tgt = tokens(step)
    logits = model(idx)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def bits(t: torch.Tensor) -> list[int]:
    """A tensor's bytes as integers (bitwise comparisons survive JSON)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).tolist()


@contextlib.contextmanager
def count_all_gathers(log: list):
    """Record (bytes received, dtype) of every all-gather FSDP2 issues (``all_gather_single``)."""
    real = dist.all_gather_single

    def spy(output_tensor, input_tensor, *args, **kwargs):
        log.append((output_tensor.numel() * output_tensor.element_size(), str(input_tensor.dtype)))
        return real(output_tensor, input_tensor, *args, **kwargs)

    dist.all_gather_single = spy
    try:
        yield
    finally:
        dist.all_gather_single = real


def build(recipe: str, gather: str, seed: int = 0, layers: str = "all"):
    torch.manual_seed(seed)
    cfg = mixprec.FP8Config(recipe, layers=layers, all_gather=gather)
    make = lambda ps: torch.optim.AdamW(ps, lr=3e-3)  # noqa: E731
    return mpd.initialize_fsdp(GPT(SMALL), make, mixprec.Recipe("O2", BF16, fp8=cfg), units=Block)


def train(recipe: str, gather: str, layers: str = "all") -> dict:
    model, opt = build(recipe, gather, layers=layers)
    fc = model.blocks[0].fc
    seen: list = []  # (type, FP8 bytes, scale) of the weight fc's forward receives

    def look(m, args):
        w = m.weight  # FSDP frees the gathered bytes after forward: copied here
        fp8 = isinstance(w, GatheredFP8Weight)
        seen.append((type(w).__name__, w.data8.clone() if fp8 else None, w.scale if fp8 else 0))

    fc.register_forward_pre_hook(look)
    losses, bytes_per_step, dtypes, checks = [], [], set(), []
    grads = None
    for step in range(STEPS):
        # the single-process cast of the whole 16-bit weight (scale from its own amax)
        full = fc.weight.full_tensor().to(BF16)
        expected = quantize(full, E4M3, None)
        log: list = []
        with count_all_gathers(log):
            loss = loss_of(model, step)
            opt.backward(loss)
        _, data, scale = seen[-1]
        if data is not None:
            checks.append(
                {
                    "data_dtype": str(data.dtype),
                    "bytes_equal": bits(data) == bits(expected.data),
                    "scale_equal": bits(scale) == bits(expected.scale),
                }
            )
        if step == 0:  # the gradient shards of the first step
            grads = torch.cat([p.grad.to_local().reshape(-1).float() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        lv = loss.detach().float().clone()
        dist.all_reduce(lv)
        losses.append(lv.item() / WORLD)
        bytes_per_step.append(sum(b for b, _ in log))
        dtypes |= {d for _, d in log}
    path = Path(os.environ["FP8G_TMP"], f"grads_{recipe}_{gather}_{layers}_{RANK}.pt")
    torch.save(grads, path)
    return {
        "losses": losses,
        "loss_bits": [bits(torch.tensor(v, dtype=torch.float64)) for v in losses],
        "gather_bytes_per_step": bytes_per_step,
        "gather_dtypes": sorted(dtypes),
        "weight_type": seen[-1][0],
        "gathered_in_fp8": gathered_in_fp8(model),
        "fp8_layer_weight_numel": sum(
            model.get_submodule(n.removesuffix(".weight")).weight.numel()
            for n in mixprec.fp8.fp8_plan(model).chosen
        ),
        "gathered_checks": checks,
    }


def train_auto() -> dict:
    """layers='auto' decides at the first batch; the small GPT is judged too small for an H100,
    so the judgement says FP8 for every candidate here, as it would for a large model."""
    from mixprec.fp8 import layers as fp8_layers
    from mixprec.fp8.choice import FP8Choice

    original = fp8_layers.decide
    fp8_layers.decide = lambda name, *a: FP8Choice(name, True, "judged FP8 (test)")
    try:
        return train("tensorwise", "auto", layers="auto")
    finally:
        fp8_layers.decide = original


def grad_diff(a: str, b: str) -> dict:
    tmp = os.environ["FP8G_TMP"]
    ga = torch.load(Path(tmp, f"grads_{a}_{RANK}.pt"))
    gb = torch.load(Path(tmp, f"grads_{b}_{RANK}.pt"))
    return {"max_abs": float((ga - gb).abs().max()), "bitwise": bool(torch.equal(ga, gb))}


def unknown_layout() -> dict:
    """A torch whose FSDP2 records lack what the hooks use: one warning, a 16-bit gather."""
    import warnings

    from mixprec.distributed import fp8_gather

    original = fp8_gather._RECORD
    fp8_gather._RECORD = (*original, "_not_in_this_torch")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, opt = build("tensorwise", "auto")
    finally:
        fp8_gather._RECORD = original
    log: list = []
    with count_all_gathers(log):
        opt.backward(loss_of(model, 0))
    opt.step()
    return {
        "warnings": [str(w.message) for w in caught if "all_gather" in str(w.message)],
        "gathered_in_fp8": gathered_in_fp8(model),
        "gather_bytes": sum(b for b, _ in log),
    }


def resume() -> dict:
    """Save after 2 steps, load into a fresh model (another seed), go on 2 more: the losses
    equal the uninterrupted run's."""
    root = Path(os.environ["FP8G_TMP"], "ckpt")
    model, opt = build("tensorwise", "auto")
    losses = []
    for step in range(4):
        if step == 2:
            mpd.save_checkpoint(root, model, opt)
        loss = loss_of(model, step)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model, opt = build("tensorwise", "auto", seed=1)
    mpd.load_checkpoint(root, model, opt)
    resumed = []
    for step in range(2, 4):
        loss = loss_of(model, step)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        resumed.append(loss.item())
    return {"uninterrupted": losses[2:], "resumed": resumed, "fp8": gathered_in_fp8(model)}


def main() -> None:
    global RANK, WORLD
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    shared = [tempfile.mkdtemp(prefix="mixprec_fp8g_") if RANK == 0 else None]
    dist.broadcast_object_list(shared)
    os.environ["FP8G_TMP"] = shared[0]
    jobs = {
        "fp8": lambda: train("tensorwise", "auto"),
        "bf16": lambda: train("tensorwise", "16-bit"),
        "bf16_again": lambda: train("tensorwise", "16-bit"),
        "grads": lambda: grad_diff("tensorwise_auto_all", "tensorwise_16-bit_all"),
        "auto": train_auto,
        "rowwise": lambda: train("rowwise", "auto"),
        "resume": resume,
        "unknown_layout": unknown_layout,
    }
    results = {}
    for name, job in jobs.items():
        try:
            results[name] = job()
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            results[name] = {"error": traceback.format_exc()}
            print(f"[rank {RANK}] {name} failed:\n{results[name]['error']}", file=sys.stderr)
        Path(args.out, f"rank{RANK}.json").write_text(json.dumps(results, indent=1))
        dist.barrier()
    if RANK == 0:  # the checkpoints the scenarios shared; every rank is past the barrier
        shutil.rmtree(shared[0], ignore_errors=True)
    shutdown()


if __name__ == "__main__":
    sys.exit(main())
