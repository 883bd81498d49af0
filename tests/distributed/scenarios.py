"""Multi-process scenarios for test_distributed.py beside it, run under torchrun (gloo, CPU).

    torchrun --standalone --nproc_per_node=2 tests/distributed/scenarios.py --out DIR [names]

Every rank runs the named scenarios (default: all) in order and writes ``DIR/rank{r}.json``:
``{scenario: {...measurements...}}`` or ``{scenario: {"error": traceback}}``. The tests assert
on these files; the scenarios only measure.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import mixprec
import mixprec.distributed as mpd
from mixprec import Recipe
from mixprec._core.optimizer import MixedPrecisionOptimizer
from mixprec.bench.models import GPT, GPTConfig
from mixprec.fp8 import fp8_plan

INF = float("inf")
BF16 = torch.bfloat16
RANK = WORLD = 0


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 4))


def batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (same on every rank); ranks take rows [rank::world]."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def local(t: torch.Tensor) -> torch.Tensor:
    return t[RANK::WORLD]


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean()


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t)
    return out


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


@contextlib.contextmanager
def spy(name: str, log: list):
    """Record (dtype, numel, op) of every tensor reaching ``torch.distributed.<name>``."""
    real = getattr(dist, name)

    def wrapper(*args, **kwargs):
        tensor = kwargs.get("input", args[1] if len(args) > 1 and "scatter" in name else None)
        tensor = tensor if tensor is not None else args[0]
        op = kwargs.get("op", dist.ReduceOp.SUM)
        log.append((str(tensor.dtype), tensor.numel(), str(op)))
        return real(*args, **kwargs)

    setattr(dist, name, wrapper)
    try:
        yield
    finally:
        setattr(dist, name, real)


def poison_local_grad(opt: MixedPrecisionOptimizer, inject: bool) -> None:
    """Call on every rank: where ``inject``, add an inf to this rank's gradients *after*
    communication, so only this rank's own check at ``step()`` can see it.

    It is a late gradient contribution the optimizer has not checked yet (a new grad tensor).
    Under FSDP every rank gets a fresh (finite or not) shard: checking DTensor gradients is
    itself a collective on torch 2.13, so all ranks must check together.
    """
    p = next(p for p in opt.master_params() if p.grad is not None)
    if not (inject or hasattr(p.grad, "to_local")):
        return
    if opt._pairs:  # 16-bit model parameter with an fp32 master (O2): a fresh 16-bit grad
        p = opt._pairs[0][0]
        g = torch.zeros_like(p)
        g.view(-1)[0] = INF
        p.grad = g
        return
    g = p.grad
    if hasattr(g, "to_local"):  # DTensor shard (FSDP)
        from torch.distributed.tensor import DTensor

        loc = g.to_local().clone()
        if inject:
            loc.view(-1)[0] = INF
        p.grad = DTensor.from_local(
            loc, g.device_mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride()
        )
    else:
        g = g.clone()
        g.view(-1)[0] = INF
        p.grad = g


# -- DDP ------------------------------------------------------------------------------------------
def scenario_wire_dtype() -> dict:
    out = {}
    for name, level, dtype, extra in (
        ("O1-bf16", "O1", torch.bfloat16, {}),
        ("O2-bf16", "O2", torch.bfloat16, {}),
        ("O2-fp16", "O2", torch.float16, {"loss_scale": mixprec.LossScaling(init_scale=256.0)}),
        ("O0-fp32", "O0", None, {}),
    ):
        model = mlp(0)
        model, opt = mixprec.initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            mixprec.Recipe(level, dtype, **extra),
        )
        ddp = mpd.wrap_ddp(model, opt)
        x, y = batch(0)
        log: list = []
        with spy("all_reduce", log):
            opt.backward(mse(ddp, local(x), local(y)))
        grad_dtypes = sorted({str(p.grad.dtype) for p in opt.master_params()})
        opt.step()
        hook = ddp.mixprec_comm_hook
        out[name] = {
            "collective_dtypes": sorted({d for d, _, op in log}),
            "collective_numel": sum(n for _, n, _ in log),
            "param_numel": sum(p.numel() for p in model.parameters()),
            "hook_dtypes": sorted(str(d) for d in hook.wire_dtypes),
            "wire_bytes": hook.wire_bytes,
            "grad_bytes": hook.grad_bytes,
            "master_grad_dtypes": grad_dtypes,
            "skipped": opt.step_skipped,
        }
    return out


def _train_poisoned(ddp, opt):
    """Four steps; at step 2 rank 1 alone gets an inf gradient. Returns (skipped, scales)."""
    skipped, scales = [], []
    for step in range(4):
        x, y = batch(step)
        opt.backward(mse(ddp, local(x), local(y)))
        if step == 2:
            poison_local_grad(opt, inject=RANK == 1)
        opt.step()
        opt.zero_grad()
        skipped.append(opt.step_skipped)
        scales.append(opt.loss_scale)
    return skipped, scales


def scenario_skip_one_rank() -> dict:
    out = {}
    for synced in (True, False):
        model = mlp(0)
        model, opt = mixprec.initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            Recipe("O2", torch.float16, loss_scale=mixprec.LossScaling(init_scale=1024.0)),
        )
        ddp = mpd.wrap_ddp(model, opt)
        if not synced:
            # control: each rank decides alone (an identity reducer, so that the plain-DDP
            # detection, which only acts on reduce_flags=None, leaves it alone)
            opt.reduce_flags = lambda flags: flags
        skipped, scales = _train_poisoned(ddp, opt)
        params = flat(model.parameters())
        others = gathered(params)
        try:
            mpd.assert_in_sync(opt)
            in_sync = "ok"
        except RuntimeError as e:
            in_sync = str(e)
        out["synced" if synced else "unsynced"] = {
            "skipped": skipped,
            "scales": scales,
            "skipped_steps": opt.skipped_steps,
            "params_equal_across_ranks": all(bitwise_equal(params, o) for o in others),
            "assert_in_sync": in_sync,
        }
    return out


def scenario_plain_ddp() -> dict:
    """``DDP(model)`` built by the user after ``initialize`` (no wrap_ddp), replicas seeded
    differently per rank: an inf on rank 1 only must skip the step on both ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for name, level, dtype, extra in (
        ("O2-fp16", "O2", torch.float16, {"loss_scale": mixprec.LossScaling(init_scale=1024.0)}),
        ("O1-bf16", "O1", torch.bfloat16, {}),
        ("O0-fp32", "O0", None, {}),
    ):
        model = mlp(RANK)  # a different init per rank: DDP broadcasts rank 0's parameters
        model, opt = mixprec.initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            mixprec.Recipe(level, dtype, **extra),
        )
        ddp = DDP(model)
        skipped, scales = _train_poisoned(ddp, opt)
        params, masters = flat(model.parameters()), flat(opt.master_params())
        out[name] = {
            "skipped": skipped,
            "scales": scales,
            "params_equal_across_ranks": all(bitwise_equal(params, o) for o in gathered(params)),
            "masters_equal_across_ranks": all(bitwise_equal(masters, o) for o in gathered(masters)),
            "verdicts_reduced": opt.reduce_flags is not None,
        }
    model = mlp(0)
    ddp = DDP(model)  # built before initialize: stale buckets, refused at the first step
    model, opt = mixprec.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", torch.bfloat16
    )
    x, y = batch(0)
    opt.backward(mse(ddp, local(x), local(y)))
    try:
        opt.step()
        out["ddp_before_initialize"] = "ok"
    except RuntimeError as e:
        out["ddp_before_initialize"] = str(e)
    return out


def scenario_ddp_equals_single() -> dict:
    out = {}
    for name, level, dtype in (("O0-fp32", "O0", None), ("O2-bf16", "O2", torch.bfloat16)):
        init = mlp(0).state_dict()
        model = mlp(100 + RANK)  # differently seeded replicas: DDP + wrap_ddp must sync them
        model, opt = mixprec.initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            level,
            dtype,
        )
        if RANK == 0:
            with torch.no_grad():  # rank 0 holds the reference init; the others get it by DDP
                for p, v in zip(model.parameters(), init.values()):
                    p.copy_(v)
                for p, m in opt._pairs:
                    m.copy_(init_value := p.float())  # noqa: F841
        ddp = mpd.wrap_ddp(model, opt)
        for step in range(4):
            x, y = batch(step)
            opt.backward(mse(ddp, local(x), local(y)))
            opt.step()
            opt.zero_grad()
        dist_w = flat(opt.master_params())
        ref = mlp(0)
        ref, ref_opt = mixprec.initialize(
            ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), level, dtype
        )
        start = flat(ref_opt.master_params())
        for step in range(4):
            x, y = batch(step)
            ref_opt.backward(mse(ref, x, y))
            ref_opt.step()
            ref_opt.zero_grad()
        ref_w = flat(ref_opt.master_params())
        out[name] = {
            "max_diff": (dist_w - ref_w).abs().max().item(),
            "update_norm": (ref_w - start).norm().item(),
            "diff_norm": (dist_w - ref_w).norm().item(),
            "ranks_equal": all(bitwise_equal(dist_w, o) for o in gathered(dist_w)),
        }
    return out


def _accumulate(model, opt, micro: list, scaled: bool, ddp=None) -> None:
    """One step over ``micro`` batches, each loss divided by their number; under ``ddp`` all
    but the last backward run in ``ddp.no_sync()``."""
    for i, (x, y) in enumerate(micro):
        last = i == len(micro) - 1
        sync = contextlib.nullcontext() if ddp is None or last else ddp.no_sync()
        with sync:
            loss = mse(ddp or model, x, y) / len(micro)
            opt.backward(loss) if scaled else loss.backward()
    opt.step()
    opt.zero_grad()


def scenario_no_sync() -> dict:
    """``DDP.no_sync()`` accumulation: 4 micro-batches per rank, the first 3 without the
    all-reduce, ``loss.backward()`` (bf16) or ``opt.backward(loss)`` (fp16, loss-scaled), against
    one process accumulating the 4 global micro-batches (each rank's rows together)."""
    out = {}
    for level in ("O1", "O2", "O3"):
        for dtype, scaled in ((BF16, False), (BF16, True), (torch.float16, True)):
            fp16 = dtype == torch.float16
            recipe = Recipe(level, dtype, loss_scale=1024.0 if fp16 else "auto")
            runs = []
            for distributed in (True, False):
                model = mlp(0)
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                model, opt = mixprec.initialize(model, opt, recipe)
                start = flat(opt.master_params())
                ddp = mpd.wrap_ddp(model, opt) if distributed else None
                for step in range(3):
                    micro = [batch(4 * step + j) for j in range(4)]
                    if distributed:
                        micro = [(local(x), local(y)) for x, y in micro]
                    _accumulate(model, opt, micro, scaled, ddp)
                runs.append(flat(opt.master_params()))
            dist_w, ref_w = runs
            out[f"{level}-{dtype}-{'opt.backward' if scaled else 'loss.backward'}"] = {
                "update_norm": (ref_w - start).norm().item(),
                "diff_norm": (dist_w - ref_w).norm().item(),
                "ranks_equal": all(bitwise_equal(dist_w, o) for o in gathered(dist_w)),
                "skipped": opt.skipped_steps,
            }
    return out


def scenario_order_errors() -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    cases = {}

    def ddp_first():
        model = mlp(0)
        ddp = DDP(model)
        _, opt = mixprec.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", torch.bfloat16
        )
        mpd.wrap_ddp(ddp, opt)

    def initialize_wrapper():
        ddp = DDP(mlp(0))
        ddp, opt = mixprec.initialize(
            ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), "O2", torch.bfloat16
        )
        mpd.wrap_ddp(ddp, opt)

    def not_initialized():
        mpd.wrap_ddp(mlp(0))

    def right_order_prebuilt():  # DDP built by the user after initialize: accepted
        model = mlp(0)
        model, opt = mixprec.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", torch.bfloat16
        )
        mpd.wrap_ddp(DDP(model), opt)

    cases = {
        "ddp_first": ddp_first,
        "initialize_wrapper": initialize_wrapper,
        "not_initialized": not_initialized,
        "right_order_prebuilt": right_order_prebuilt,
    }
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001 - the message is the measurement
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _ckpt_run(steps: int, save_at: int | None, path: str, fsdp: bool) -> dict:
    """Train ``steps`` steps; with ``save_at``, save there, rebuild everything, load, go on."""

    SCALING = mixprec.LossScaling(init_scale=2.0**14, growth_interval=2, hysteresis=2)

    def build(seed: int):
        if fsdp:
            model = mlp(seed)
            return mpd.initialize_fsdp(
                model,
                lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                mixprec.Recipe("O2", torch.float16, loss_scale=SCALING),
            )
        model = mlp(seed)
        model, opt = mixprec.initialize(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            mixprec.Recipe("O2", torch.float16, loss_scale=SCALING),
        )
        return mpd.wrap_ddp(model, opt), opt

    model, opt = build(0)
    for step in range(steps):
        if step == save_at:
            mpd.save_checkpoint(path, model, opt)
            model, opt = build(7)  # different init: everything must come from the checkpoint
            mpd.load_checkpoint(path, model, opt)
        x, y = batch(step)
        opt.backward(mse(model, local(x), local(y)) * (1e6 if step == 1 else 1.0))
        if step == 3:
            poison_local_grad(opt, inject=RANK == 0)
        opt.step()
        opt.zero_grad()
    weights = flat(mpd.fp32_full_state_dict(model, opt).values())
    inner = [
        t for s in opt.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    if fsdp:
        inner = [t.to_local() if hasattr(t, "to_local") else t for t in inner]
    return {
        "weights": weights,
        "inner": flat(inner),
        "scaler": opt.slots[0].scaler.state_dict(),
        "skipped_steps": opt.skipped_steps,
    }


def _ckpt(fsdp: bool) -> dict:
    tmp = Path(os.environ["MIXPREC_DIST_TMP"]) / ("fsdp_ckpt" if fsdp else "ddp_ckpt.pt")
    full = _ckpt_run(6, None, str(tmp), fsdp)
    resumed = _ckpt_run(6, 3, str(tmp), fsdp)
    return {
        "weights_bitwise": bitwise_equal(full["weights"], resumed["weights"]),
        "inner_state_bitwise": bitwise_equal(full["inner"], resumed["inner"]),
        "scaler_full": full["scaler"],
        "scaler_resumed": resumed["scaler"],
        "skipped_full": full["skipped_steps"],
        "skipped_resumed": resumed["skipped_steps"],
        "weights_max_diff": (full["weights"] - resumed["weights"]).abs().max().item(),
    }


def scenario_ckpt_ddp() -> dict:
    return _ckpt(fsdp=False)


def scenario_ckpt_fsdp() -> dict:
    return _ckpt(fsdp=True)


def scenario_exact_masters() -> dict:
    """fp32 weights loaded before or after initialize come back bit for bit from
    ``fp32_full_state_dict`` (FSDP2 O2 and DDP O2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    pretrained = {k: v.clone() for k, v in mlp(11).state_dict().items()}
    out = {}
    for fsdp in (False, True):
        for order in ("load_then_init", "init_then_load"):
            model = mlp(3)
            if order == "load_then_init":
                model.load_state_dict(pretrained)
            if fsdp:
                model, opt = mpd.initialize_fsdp(
                    model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), "O2", BF16
                )
            else:
                model, opt = mixprec.initialize(
                    model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2", BF16
                )
                model = mpd.wrap_ddp(model, opt)
            if order == "init_then_load":
                if fsdp:
                    set_model_state_dict(  # it turns the dict's values into DTensors
                        model,
                        {k: v.clone() for k, v in pretrained.items()},
                        options=StateDictOptions(full_state_dict=True),
                    )
                else:
                    model.module.load_state_dict(pretrained)
            got = mpd.fp32_full_state_dict(model, opt)
            out[f"{'fsdp' if fsdp else 'ddp'}.{order}"] = sorted(got) == sorted(pretrained) and all(
                bitwise_equal(got[k], pretrained[k]) for k in pretrained
            )
    return out


# -- FSDP2 ----------------------------------------------------------------------------------------
GPT_SMALL = GPTConfig(vocab_size=32, block_size=32, n_layer=2, n_head=2, n_embd=64)


def tokens(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable toy language: each sequence counts up by a per-sequence stride (mod 32)."""
    g = torch.Generator().manual_seed(5000 + step)
    start = torch.randint(0, 32, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + stride * torch.arange(33)) % 32
    return seq[:, :-1], seq[:, 1:]


def gpt_loss(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def _train_gpt(fsdp: bool, steps: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPT_SMALL)
    make = lambda ps: torch.optim.AdamW(ps, lr=3e-3)  # noqa: E731
    if fsdp:
        from mixprec.bench.models import Block

        model, opt = mpd.initialize_fsdp(model, make, "O2", torch.bfloat16, units=Block)
    else:
        model, opt = mixprec.initialize(model, make(model.parameters()), "O2", torch.bfloat16)
        model = mpd.wrap_ddp(model, opt)
    losses, log = [], []
    for step in range(steps):
        idx, tgt = tokens(step)
        with spy("reduce_scatter_single", log), spy("all_reduce", log):
            loss = gpt_loss(model, local(idx), local(tgt))
            opt.backward(loss)
            opt.clip_grad_norm_(1.0)
        if step == 3:  # both runs skip this step: the same number of updates
            poison_local_grad(opt, inject=RANK == 1)
        opt.step()
        opt.zero_grad()
        lv = loss.detach().clone()
        dist.all_reduce(lv)
        losses.append(lv.item() / WORLD)
    p = next(iter(opt.master_params()))
    return {
        "losses": losses,
        "skipped_steps": opt.skipped_steps,
        "param_type": type(p).__name__,
        "param_dtype": str(p.dtype),
        "output_dtype": str(model(local(tokens(0)[0])).dtype),
        "grad_comm_dtypes": sorted({d for d, _, op in log if "MAX" not in op}),
    }


# -- mixprec.amp: torch.amp code under plain DDP and FSDP2 ---------------------------------------
def _amp_poison(model: nn.Module, inject: bool) -> None:
    """After backward (after DDP's all-reduce / FSDP's reduce-scatter): where ``inject``, an inf
    in this rank's gradients only. Every rank replaces its gradient tensor the same way."""
    p = next(p for p in model.parameters() if p.grad is not None)
    g = p.grad
    if hasattr(g, "to_local"):  # DTensor shard (FSDP2)
        from torch.distributed.tensor import DTensor

        loc = g.to_local().clone()
        if inject:
            loc.view(-1)[0] = INF
        p.grad = DTensor.from_local(
            loc, g.device_mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride()
        )
    elif inject:
        g = g.clone()
        g.view(-1)[0] = INF
        p.grad = g


def _amp_train(amp, wrap, poison: str) -> dict:
    """Four steps of the torch.amp recipe on a wrapped model; at step 2 rank 1 alone gets an
    inf: after communication (``poison="late"``) or in its input (``"input"``)."""
    model = wrap(mlp(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler("cpu", init_scale=1024.0)
    skipped, scales = [], []
    for step in range(4):
        x, y = batch(step)
        x, y = local(x), local(y)
        if step == 2 and poison == "input" and RANK == 1:
            x = x.clone()
            x[0, 0] = INF
        with amp.autocast("cpu", torch.float16):
            loss = mse(model, x, y)
        scaler.scale(loss).backward()
        if step == 2 and poison == "late":
            _amp_poison(model, inject=RANK == 1)
        before = flat(p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        after = flat(p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
        skipped.append(bool(torch.equal(before, after)))
        scales.append(scaler.get_scale())
    params = flat(p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters())
    out = {
        "skipped": skipped,
        "scales": scales,
        "params_equal_across_ranks": all(bitwise_equal(params, o) for o in gathered(params)),
    }
    if hasattr(scaler, "skipped_steps"):
        out["skipped_steps"] = scaler.skipped_steps
    return out


def _ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model)


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for m in model:
        if any(True for _ in m.parameters()):
            fully_shard(m, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def scenario_amp_plain_ddp() -> dict:
    """``import mixprec.amp as amp`` in torch.amp code under a plain DDP(model); torch.amp's own
    scaler is the control."""
    import mixprec.amp as mp_amp

    out = {}
    for name, amp in (("mixprec", mp_amp), ("torch", torch.amp)):
        for poison in ("late", "input"):
            out[f"{name}.{poison}"] = _amp_train(amp, _ddp, poison)
    return out


def scenario_amp_fsdp2() -> dict:
    """The same under FSDP2 (``fully_shard``): the gradients are DTensor shards."""
    import mixprec.amp as mp_amp

    out = {}
    for name, amp in (("mixprec", mp_amp), ("torch", torch.amp)):
        for poison in ("late", "input"):
            out[f"{name}.{poison}"] = _amp_train(amp, _fsdp2, poison)
    return out


def scenario_fsdp_gpt() -> dict:
    steps = 14
    return {"ddp": _train_gpt(False, steps), "fsdp": _train_gpt(True, steps)}


def _train_fp8(fsdp: bool, steps: int) -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode

    from mixprec.bench.models import Block
    from mixprec.fp8.quantization import E4M3, amax, scale_for

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func.overloadpacket.__name__ == "_scaled_mm"
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = GPT(GPT_SMALL)
    make = lambda ps: torch.optim.AdamW(ps, lr=3e-3)  # noqa: E731
    cfg = mixprec.FP8Config(layers="all")
    if fsdp:
        model, opt = mpd.initialize_fsdp(
            model, make, mixprec.Recipe("O2", torch.bfloat16, fp8=cfg), units=Block
        )
        inner = model
    else:
        model, opt = mixprec.initialize(
            model, make(model.parameters()), mixprec.Recipe("O2", torch.bfloat16, fp8=cfg)
        )
        inner = model
        model = mpd.wrap_ddp(model, opt)
    scales: list[float] = []
    fc = inner.blocks[0].fc  # the weight as the FP8 layer sees it (FSDP: all-gathered)
    hook = fc.register_forward_pre_hook(
        lambda m, a: scales.append(float(scale_for(amax(m.weight), E4M3)))
    )
    losses = []
    for step in range(steps):
        idx, tgt = tokens(step)
        with Count():
            loss = gpt_loss(model, local(idx), local(tgt))
            opt.backward(loss)
        opt.step()
        opt.zero_grad()
        lv = loss.detach().clone()
        dist.all_reduce(lv)
        losses.append(lv.item() / WORLD)
    hook.remove()
    mine = torch.tensor(scales, dtype=torch.float64)
    return {
        "losses": losses,
        "scaled_mm_per_step": Count.n / steps,
        "fp8_layers": fp8_plan(inner).chosen,
        "scales_equal_across_ranks": all(bitwise_equal(mine, o) for o in gathered(mine)),
        "scales_change": len(set(scales)) > 1,
    }


def scenario_fp8() -> dict:
    steps = 8
    return {"ddp": _train_fp8(False, steps), "fsdp": _train_fp8(True, steps)}


def scenario_fp8_auto_agrees() -> dict:
    """Ranks that judge their batches differently still run the same layers in FP8."""
    from mixprec.fp8 import layers as fp8_layers
    from mixprec.fp8.choice import FP8Choice

    def judged(name, recipe, x, weight, target):  # rank 0's batch says FP8, rank 1's says no
        return FP8Choice(name, RANK == 0, f"rank {RANK}'s numbers")

    original = fp8_layers.decide
    fp8_layers.decide = judged
    try:
        model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 4))
        model = mixprec.initialize(model, None, Recipe("O2", torch.bfloat16, fp8=True))
        with torch.no_grad():
            model(torch.randn(4, 16))
        plan = fp8_plan(model)
        return {"chosen": plan.chosen, "reason": plan["0"].reason}
    finally:
        fp8_layers.decide = original


# -- FSDP2 with update modes: 16-bit shards, no masters -----------------------------------------
def wide_mlp(seed: int) -> nn.Module:
    """Weights of >= 4096 elements (8-bit optimizer codes) and small ones (kept fp32)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 8)
    )


def wide_batch(step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(n, 64, generator=g), torch.randn(n, 8, generator=g)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _train_updates(recipe: Recipe, steps: int, how: str) -> dict:
    """``steps`` steps on the global batch: ``how`` = "fsdp" (2 ranks, rows [rank::2] each),
    "single" (one process, the whole batch) or "micro" (one process, the ranks' rows as two
    micro-batches of half the loss each: the gradient arithmetic of 2-rank data parallelism)."""
    if how == "fsdp-meta":  # built on the meta device, filled shard by shard
        with torch.device("meta"):
            model = wide_mlp(0)
    else:
        model = wide_mlp(0)
    if how.startswith("fsdp"):
        model, opt = mpd.initialize_fsdp(model, _adamw, recipe)
        how = "fsdp"
    else:
        model, opt = mixprec.initialize(model, _adamw(model.parameters()), recipe)
    for step in range(steps):
        x, y = wide_batch(step)
        if how == "fsdp":
            opt.backward(mse(model, local(x), local(y)))
        elif how == "single":
            opt.backward(mse(model, x, y))
        else:
            for r in range(WORLD):
                opt.backward(mse(model, x[r::WORLD], y[r::WORLD]) * (1.0 / WORLD))
        opt.step()
        opt.zero_grad()
    params = dict(model.named_parameters())
    export = (
        mpd.fp32_full_state_dict(model, opt)
        if how == "fsdp"
        else mixprec.fp32_state_dict(model, opt)
    )
    out = {
        "fp32_export": {k: v.detach().float().cpu() for k, v in export.items()},
        "weights": {
            k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
            for k, p in params.items()
        },
        "dtypes": sorted({str(p.dtype) for p in params.values()}),
        "released": bool(opt.updater is not None and opt.updater.gradients == "released"),
        "skipped": opt.skipped_steps,
    }
    if how == "fsdp":
        first = params["0.weight"]
        out["param_type"] = type(first).__name__
        out["local_rows"] = first.to_local().shape[0]
        out["state_kinds"] = sorted(
            {f"{k}:{type(v).__name__}" for st in opt.state.values() for k, v in st.items()}
        )
    return out


def _max_diff(a: dict, b: dict) -> float:
    return max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"])


def _equal(a: dict, b: dict) -> bool:
    return all(bitwise_equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


def scenario_fsdp_update_modes() -> dict:
    """FSDP2 with 16-bit shards stepped by an update mode against one process, same data."""
    steps, out = 6, {}
    cases = {
        "lean": Recipe("lean", BF16),
        "lean_fp32_reduce": Recipe("lean", BF16, reduce_dtype=torch.float32),
        "kahan": Recipe("O3", BF16, update="kahan"),
    }
    for name, recipe in cases.items():
        fsdp = _train_updates(recipe, steps, "fsdp")
        held = recipe.replace(gradients="held")
        micro = _train_updates(held, steps, "micro")
        single = _train_updates(held, steps, "single")
        res = {
            "fsdp_vs_micro_equal": _equal(fsdp, micro),
            "fsdp_vs_micro_max_diff": _max_diff(fsdp, micro),
            "fsdp_vs_single_max_diff": _max_diff(fsdp, single),
            "moved": _max_diff(fsdp, _train_updates(held, 0, "single")),
            # the fp32 export (w + c under Kahan) of the shards, gathered, is one process's
            "export_equal": sorted(fsdp["fp32_export"]) == sorted(micro["fp32_export"])
            and all(
                bitwise_equal(v, micro["fp32_export"][k]) for k, v in fsdp["fp32_export"].items()
            ),
            "export_is_not_the_weights": any(
                not bitwise_equal(v, fsdp["weights"][k]) for k, v in fsdp["fp32_export"].items()
            ),
            **{k: v for k, v in fsdp.items() if k not in ("weights", "fp32_export")},
        }
        if recipe.update == "stochastic":  # released in backward where one process allows it
            # (from the first step: "auto"'s first one codes them)
            released = _train_updates(recipe.replace(gradients="released"), steps, "single")
            res["single_released"] = released["released"]
            res["single_released_equal_held"] = _equal(released, single)
        out[name] = res
    # context: fp32 training differs between the whole batch and two micro-batches as well
    fp32 = [_train_updates(Recipe("O0"), steps, how) for how in ("single", "micro")]
    out["fp32_single_vs_micro_max_diff"] = _max_diff(*fp32)
    try:
        mpd.initialize_fsdp(wide_mlp(0), _adamw, Recipe("lean", BF16, gradients="released"))
        out["released_refused"] = ""
    except ValueError as e:
        out["released_refused"] = str(e)
    return out


class _RawParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


def scenario_fsdp_meta() -> dict:
    """A model built on the meta device: each rank fills its own shards; the run equals the one
    built on the device under the same seed (O2's fp32 shards, "lean", Kahan from its fp32
    residual); a module it cannot fill is refused."""
    steps, out = 3, {}
    for name, recipe in {
        "O2": Recipe("O2", BF16),
        "lean": Recipe("lean", BF16),
        "kahan": Recipe("O3", BF16, update="kahan"),
    }.items():
        built = _train_updates(recipe, steps, "fsdp")
        meta = _train_updates(recipe, steps, "fsdp-meta")
        out[name] = {"equal": _equal(built, meta), "max_diff": _max_diff(meta, built)}
    with torch.device("meta"):
        raw = nn.Sequential(nn.Linear(4, 4), _RawParameter())
    try:
        mpd.initialize_fsdp(raw, _adamw, Recipe("O2", BF16))
        out["refused"] = ""
    except ValueError as e:
        out["refused"] = str(e)
    return out


def scenario_ddp_lean() -> dict:
    """DDP with "lean": gradients held (released ones would be stepped before DDP reduces
    them, so that is refused); the replicas' weights and 8-bit states stay identical."""
    out: dict = {}
    model = wide_mlp(0)
    model, opt = mixprec.initialize(model, _adamw(model.parameters()), Recipe("lean", BF16))
    try:
        mpd.wrap_ddp(model, opt)
        out["released_refused"] = ""
    except ValueError as e:
        out["released_refused"] = str(e)
    model = wide_mlp(0)
    model, opt = mixprec.initialize(
        model, _adamw(model.parameters()), Recipe("lean", BF16, gradients="held")
    )
    ddp = mpd.wrap_ddp(model, opt)
    first = flat([p.detach().float() for p in model.parameters()])
    for step in range(4):
        x, y = wide_batch(step)
        opt.backward(mse(ddp, local(x), local(y)))
        opt.step()
        opt.zero_grad()
    weights = flat([p.detach().float() for p in model.parameters()])
    codes = [
        v.codes for st in opt.optimizer.state.values() for v in st.values() if hasattr(v, "codes")
    ]
    out["moved"] = (weights - first).abs().max().item()
    out["ranks_equal"] = all(bitwise_equal(weights, o) for o in gathered(weights))
    out["coded_states"] = len(codes)
    out["codes_equal"] = all(
        bitwise_equal(c.float(), o) for c in codes for o in gathered(c.float())
    )
    return out


# -- DCP checkpoints of every recipe under FSDP2 ------------------------------------------------
DCP_RECIPES = {
    "O2": Recipe("O2", BF16),
    "kahan": Recipe("O3", BF16, update="kahan"),
    "kahan_fp16": Recipe("O3", torch.float16, update="kahan"),  # a loss scaler to restore
    "nearest": Recipe("O3", BF16, update="nearest"),
    "lean": Recipe("lean", BF16),  # stochastic rounding, 8-bit states
    "lean_4bit": Recipe("lean", BF16, optimizer_states="4-bit"),
    "lean_uneven": Recipe("lean", BF16),  # on dcp_mlp(uneven=True): see DCP_MODELS
}
#: model options per case: 127 rows shard 64 / 63, and 63 x 65 = 4095 elements is one short of
#: a coded state, so rank 0 holds 0.weight's moments in codes and rank 1 in fp32
DCP_MODELS = {"lean_uneven": {"uneven": True}}


def dcp_mlp(seed: int, extra_layers: int = 0, uneven: bool = False) -> nn.Module:
    """Coded states on both ranks' shards (>= 4096 elements each), one with rows of odd length
    (65: 4-bit codes end a row in half a byte), small fp32-state tensors, and two buffers
    (unused by the forward) the checkpoint and the fp32 exports carry."""
    torch.manual_seed(seed)
    width = 127 if uneven else 128
    layers = [nn.Linear(65, width), nn.ReLU(), nn.Linear(width, 64), nn.ReLU()]
    layers += [m for _ in range(extra_layers) for m in (nn.Linear(64, 64), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(64, 8))
    model.register_buffer("seen", torch.tensor(seed))  # buffers travel with the checkpoint
    model.register_buffer("shift", torch.linspace(-1.0, 1.0, 8))
    return model


def dcp_batch(step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(n, 65, generator=g), torch.randn(n, 8, generator=g)


def _dcp_build(recipe: Recipe, seed: int, extra_layers: int = 0, uneven: bool = False):
    """As a user builds it: a fresh model, initialize_fsdp with an optimizer_fn and units."""
    return mpd.initialize_fsdp(
        dcp_mlp(seed, extra_layers, uneven),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
        recipe,
        units=nn.Linear,
    )


def _local_state(model: nn.Module, opt: MixedPrecisionOptimizer) -> torch.Tensor:
    """This rank's shards of everything a resume must restore, as one flat fp32 tensor."""
    parts = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    for st in opt.optimizer.state.values():
        for _, v in sorted(st.items()):
            if hasattr(v, "codes"):
                parts += [v.codes, v.scale]
            elif isinstance(v, torch.Tensor):
                parts.append(v.to_local() if hasattr(v, "to_local") else v)
    if opt.updater is not None:
        parts += list(opt.updater.compensation.values())
        parts.append(torch.tensor(float(opt.updater.steps)))
    parts += [torch.tensor(float(opt.skipped_steps))]
    return flat(parts)


def _dcp_run(
    recipe: Recipe, steps: int, save_at: int | None, path: str, poison_at: int, **model_kw
) -> dict:
    """``steps`` steps; with ``save_at``: save there, build everything again from another seed
    (so all of it must come from the checkpoint), load, go on. Rank 1 alone gets an inf
    gradient at ``poison_at``."""
    model, opt = _dcp_build(recipe, 0, **model_kw)
    coded, plain_loss = {}, None
    losses, skipped, saved = [], [], {}
    for step in range(steps):
        if step == save_at:
            coded = {  # which of this rank's states are held in codes when it saves
                f"{n}.{k}": hasattr(v, "codes")
                for n, p in model.named_parameters()
                for k, v in opt.optimizer.state.get(p, {}).items()
                if k != "step"
            }
            mpd.save_checkpoint(path, model, opt)
            plain_loss = _export_live(model, opt, path, step, **model_kw)
            model, opt = _dcp_build(recipe, 7, **model_kw)
            mpd.load_checkpoint(path, model, opt)
        x, y = dcp_batch(step)
        loss = mse(model, local(x), local(y))
        opt.backward(loss)
        if step == poison_at:
            poison_local_grad(opt, inject=RANK == 1)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        skipped.append(opt.step_skipped)
    if save_at is not None and RANK == 0:
        from torch.distributed.checkpoint import FileSystemReader

        index = FileSystemReader(path).read_metadata().state_dict_metadata
        saved = {
            k: str(v.properties.dtype).removeprefix("torch.")
            for k, v in index.items()
            if hasattr(v, "properties")
            and k.split(".")[0] in ("model", "optimizer", "compensation")
        }
    weights = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float()
        for k, v in model.named_parameters()
    }
    return {
        "losses": losses,
        "skipped": skipped,
        "weights": flat(weights.values()),
        "local_state": _local_state(model, opt),
        "saved_dtypes": saved,
        "files": sorted(
            (f.name, f.stat().st_size) for f in Path(path).glob("*.distcp") if save_at is not None
        ),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "scalers": [s.scaler.state_dict() for s in opt.slots],
        "coded_at_save": coded,
        "plain_loss": plain_loss,
    }


def _export_live(model: nn.Module, opt, path: str, step: int, **model_kw) -> float | None:
    """``fp32_full_state_dict`` at the save (a collective), written by rank 0 beside the
    checkpoint as ``<path>_fp32.pt``; and the loss of step ``step``'s batch in the model built
    without mixprec from it (rank 0; the offline export must give the same)."""
    live = mpd.fp32_full_state_dict(model, opt)
    if RANK != 0:
        return None
    torch.save(live, path + "_fp32.pt")
    plain = dcp_mlp(1, **model_kw)
    plain.load_state_dict(live, strict=True)
    with torch.no_grad():
        return mse(plain, *dcp_batch(step)).item()


def scenario_dcp_resume() -> dict:
    """4 steps, save, fresh model and optimizer, load, 3 more (inf on rank 1 at the
    second step after the resume) == 7 uninterrupted steps, bit for bit, for every recipe. The
    checkpoints and the live fp32 exports at the save stay in ``--out`` for the offline test."""
    out = {}
    root = Path(os.environ["MIXPREC_DIST_OUT"])  # the offline export test reads them
    for name, recipe in DCP_RECIPES.items():
        path = str(root / f"dcp_{name}")
        kw = DCP_MODELS.get(name, {})
        full = _dcp_run(recipe, 7, None, path, poison_at=5, **kw)
        resumed = _dcp_run(recipe, 7, 4, path, poison_at=5, **kw)
        out[name] = {
            "losses_equal": full["losses"] == resumed["losses"],
            "losses": resumed["losses"],
            "weights_bitwise": bitwise_equal(full["weights"], resumed["weights"]),
            "state_bitwise": bitwise_equal(full["local_state"], resumed["local_state"]),
            "skipped_full": full["skipped"],
            "skipped_resumed": resumed["skipped"],
            "ranks_equal": all(
                bitwise_equal(resumed["weights"], o) for o in gathered(resumed["weights"])
            ),
            "saved_dtypes": resumed["saved_dtypes"],
            "files": resumed["files"],
            "param_dtypes": resumed["param_dtypes"],
            "scalers_equal": full["scalers"] == resumed["scalers"],
            "scalers": resumed["scalers"],
            "coded_at_save": resumed["coded_at_save"],
            "plain_loss": resumed["plain_loss"],
        }
    return out


def scenario_reshard_save() -> dict:
    """The 2-rank half of ``reshard.py`` (save at step 4, the uninterrupted run's gathered
    tensors kept): ``test_distributed.py`` loads it on 1 and on 4 ranks in launches of its own."""
    import reshard

    # this file runs as __main__: the "scenarios" module reshard imports is a second copy
    reshard.S.RANK, reshard.S.WORLD = RANK, WORLD
    reshard.save(Path(os.environ["MIXPREC_DIST_OUT"]) / "reshard", list(reshard.CASES))
    return {"saved": sorted(reshard.CASES)}


def _refused(call) -> str:
    try:
        call()
    except (ValueError, FileNotFoundError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def scenario_dcp_bad_input() -> dict:
    """Loading a checkpoint into a model prepared otherwise (in what no recipe change carries:
    the dtype, the rounding seed, the depth), or a cut-off checkpoint, is refused with what
    differs, and leaves the model and optimizer as they were."""
    root = Path(os.environ["MIXPREC_DIST_TMP"])
    good = root / "dcp_bad_lean"
    model, opt = _dcp_build(DCP_RECIPES["lean"], 0)
    for step in range(2):
        x, y = dcp_batch(step)
        opt.backward(mse(model, local(x), local(y)))
        opt.step()
        opt.zero_grad()
    mpd.save_checkpoint(good, model, opt)
    o2 = root / "dcp_bad_o2"
    model2, opt2 = _dcp_build(DCP_RECIPES["O2"], 0)
    mpd.save_checkpoint(o2, model2, opt2)
    # a save over an existing checkpoint that dies before it finishes (here: before DCP writes)
    over = root / "dcp_bad_overwritten"
    mpd.save_checkpoint(over, model, opt)
    import torch.distributed.checkpoint as dcp

    real, dcp.save = dcp.save, lambda *a, **k: (_ for _ in ()).throw(OSError("killed"))
    try:
        mpd.save_checkpoint(over, model, opt)
    except OSError:
        pass
    finally:
        dcp.save = real
    cut, no_index = root / "dcp_bad_cut", root / "dcp_bad_noindex"
    if RANK == 0:
        import shutil

        for copy in (cut, no_index):
            shutil.copytree(good, copy)
        data = max(cut.glob("*.distcp"))
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        (no_index / ".metadata").unlink()
    dist.barrier()
    cases = {
        # another recipe's layout is carried over (cross_recipe.py); these are not
        "other_seed": (Recipe("lean", BF16, update_seed=1), 0, good),
        "other_dtype": (Recipe("lean", torch.float16), 0, good),
        "o2_other_dtype": (Recipe("lean", torch.float16), 0, o2),
        "other_depth": (DCP_RECIPES["lean"], 1, good),
        "o2_other_depth": (DCP_RECIPES["kahan"], 1, o2),
        "cut_off": (DCP_RECIPES["lean"], 0, cut),
        "no_index": (DCP_RECIPES["lean"], 0, no_index),
        "overwrite_cut_off": (DCP_RECIPES["lean"], 0, over),
    }
    out = {}
    for name, (recipe, extra, path) in cases.items():
        model, opt = _dcp_build(recipe, 7, extra)
        x, y = dcp_batch(0)
        opt.backward(mse(model, local(x), local(y)))
        opt.step()
        opt.zero_grad()
        before = _local_state(model, opt)
        error = _refused(lambda: mpd.load_checkpoint(path, model, opt))  # noqa: B023
        out[name] = {
            "error": error,
            "unchanged": bitwise_equal(before, _local_state(model, opt)),
        }
    model, opt = _dcp_build(DCP_RECIPES["lean"], 7)  # the good one still loads
    mpd.load_checkpoint(good, model, opt)
    out["good_loads"] = opt.updater.steps == 2
    # saved before the first step (no optimizer state yet): loads, and both go on alike
    before = root / "dcp_before_step"
    runs = [_dcp_build(DCP_RECIPES["lean"], 0), _dcp_build(DCP_RECIPES["lean"], 7)]
    mpd.save_checkpoint(before, *runs[0])
    mpd.load_checkpoint(before, *runs[1])
    for model, opt in runs:
        x, y = dcp_batch(0)
        opt.backward(mse(model, local(x), local(y)))
        opt.step()
    out["before_step_resumes"] = bitwise_equal(*(_local_state(*run) for run in runs))
    # an O2 checkpoint written before checkpoints recorded their recipe still loads
    from mixprec.distributed.checkpoint import _dcp_state

    legacy = root / "dcp_legacy_o2"
    runs = [_dcp_build(DCP_RECIPES["O2"], 0), _dcp_build(DCP_RECIPES["O2"], 7)]
    dcp.save(_dcp_state(*runs[0]), checkpoint_id=str(legacy))
    mpd.load_checkpoint(legacy, *runs[1])
    out["legacy_o2_loads"] = bitwise_equal(*(flat(m.parameters()) for m, _ in runs))
    return out


def scenario_batch_norm() -> dict:
    """A model with BatchNorm1d (running statistics: buffers FSDP does not cast) under each
    recipe: trains, and stores the statistics as ``initialize`` does in one process."""
    out = {}
    recipes = {"O2": "O2", "O3": "O3", "O3 kahan": Recipe("O3", update="kahan"), "lean": "lean"}
    for name, recipe in recipes.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        one = copy.deepcopy(model)
        single, _ = mixprec.initialize(one, _adamw(one.parameters()), recipe, torch.bfloat16)
        model, opt = mpd.initialize_fsdp(model, _adamw, recipe, torch.bfloat16)
        losses, (x, y) = [], batch(0)
        for _ in range(6):
            loss = mse(model, x[RANK::WORLD], y[RANK::WORLD])
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        out[name] = {
            "losses": losses,
            "stats_dtype": str(model[1].running_mean.dtype),
            "single_stats_dtype": str(single[1].running_mean.dtype),
        }
    return out


def shutdown() -> None:
    """End a launch: collect the cyclic garbage (modules with hooks, optimizers, FSDP state)
    that still holds process groups, wait for every rank, then destroy the groups. Left to the
    interpreter's exit, a rank that finished first destroyed objects holding gloo's threads
    during finalization and aborted ("terminate called without an active exception") in about
    one 4-rank launch in eight on 2 busy cores; none in twelve with this."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


SCENARIOS = {
    name[len("scenario_") :]: fn for name, fn in globals().items() if name.startswith("scenario_")
}


def main() -> None:
    global RANK, WORLD
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("names", nargs="*", default=list(SCENARIOS))
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    shared = [tempfile.mkdtemp(prefix="mixprec_dist_") if RANK == 0 else None]
    dist.broadcast_object_list(shared)
    os.environ["MIXPREC_DIST_TMP"] = shared[0]
    os.environ["MIXPREC_DIST_OUT"] = str(Path(args.out).resolve())
    results = {}
    for name in args.names:
        try:
            results[name] = SCENARIOS[name]()
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            results[name] = {"error": traceback.format_exc()}
            print(
                f"[rank {RANK}] scenario {name} failed:\n{results[name]['error']}",
                file=sys.stderr,
                flush=True,
            )
        Path(args.out, f"rank{RANK}.json").write_text(json.dumps(results, indent=1))
        dist.barrier()
    if RANK == 0:  # the checkpoints the scenarios shared; every rank is past the barrier
        shutil.rmtree(shared[0], ignore_errors=True)
    shutdown()


if __name__ == "__main__":
    sys.exit(main())
