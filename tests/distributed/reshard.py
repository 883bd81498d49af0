"""Update-mode FSDP2 checkpoints loaded on another number of ranks (resharding).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 \\
        tests/distributed/reshard.py --dir /tmp/rs save
    for n in 1 4; do OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=$n \\
        tests/distributed/reshard.py --dir /tmp/rs load; done

writes ``/tmp/rs/from2/load_1.json`` and ``load_4.json``; ``save`` on 4 ranks and ``load
--saved-by 4`` on 2 is the 4 -> 2 direction (the suite runs ``load save`` in its 4-rank
launch); ``--cases`` (and ``--save-cases``) pick cases of :data:`CASES`.

``save`` (2 ranks, the suite runs it inside its 2-rank launch as the scenario
``reshard_save``; or 4): per case and data mode, 4 steps, ``save_checkpoint``, then 3 more steps;
rank 0 keeps the whole tensors (gathered) at the save and after the 3 steps, and the global
losses. ``load`` (any number of ranks): a model built from another seed, ``load_checkpoint``,
3 steps; rank 0 writes ``load_<n>.json``: which gathered tensors equal the saving run's bit for
bit right after the load and after the 3 steps, how far the others are, and the losses.

Data modes: ``split`` -- each step's global batch of 16 rows split over the ranks (rows
``rank::world``), as a resumed run on another number of ranks trains; its gradient is
rounded differently (bf16 per micro-batch), so only the loss is compared. ``same`` -- every
rank steps on the same 4 rows, so the reduced gradient is the same on any number of ranks and
the update itself is compared: bit for bit where each state is coded (or not) as before.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scenarios as S

import mixprec.distributed as mpd
from mixprec import Recipe
from mixprec._core.update.state_codes import QuantizedState
from mixprec.distributed._dcp_layout import _by_rows, _code_widths, _like_param, codes_by_row

BF16 = torch.bfloat16
#: case -> (recipe, width of the first layer). Rows of 65 elements (4-bit rows end in half a
#: byte). Width 256: 0.weight's and 2.weight's shards are >= 4096 elements on 1, 2 and 4 ranks,
#: so their states are coded everywhere. Width 127: 0.weight is coded on rank 0 of 2 (64 rows,
#: 4160), not on rank 1 (63 rows, 4095), coded on 1 rank, on no rank of 4; 2.weight (64 x 127)
#: is coded on 1 and 2 ranks, not on 4.
CASES = {
    "O2": (Recipe("O2", BF16), 128),
    "kahan": (Recipe("O3", BF16, update="kahan"), 128),
    "lean_wide": (Recipe("lean", BF16), 256),
    "lean_4bit_wide": (Recipe("lean", BF16, optimizer_states="4-bit"), 256),
    "lean_uneven": (Recipe("lean", BF16), 127),
}
MODES = ("split", "same")
SAVE_AT, STEPS = 4, 7


def build(recipe: Recipe, width: int, seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(65, width), nn.ReLU(), nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 8)
    )
    return mpd.initialize_fsdp(
        model,
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
        recipe,
        units=nn.Linear,
    )


def step(model, opt, i: int, mode: str) -> float:
    """One step; the global loss (the mean of the ranks' equal-sized micro-batches)."""
    x, y = S.dcp_batch(i)
    if mode == "same":
        x, y = x[:4], y[:4]
    else:
        x, y = x[S.RANK :: S.WORLD], y[S.RANK :: S.WORLD]
    loss = S.mse(model, x, y)
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    g = loss.detach().float().clone()
    dist.all_reduce(g)
    return g.item() / S.WORLD


def gathered_state(model, opt) -> tuple[dict[str, torch.Tensor], dict[str, list[bool]]]:
    """Whole tensors (a collective): weights ``w.``, the values each state's next step reads
    ``v.`` (decoded codes), codes and scales ``codes.``/``scale.`` of states coded on every
    rank, compensation ``c.``; and per state which ranks hold it in codes."""
    out: dict[str, torch.Tensor] = {}
    coded: dict[str, list[bool]] = {}
    comps = opt.updater.compensation if opt.updater is not None else {}
    for n, p in model.named_parameters():
        out[f"w.{n}"] = p.detach().full_tensor().float()
        for k, v in sorted(opt.optimizer.state.get(p, {}).items()):
            if not isinstance(v, (torch.Tensor, QuantizedState)) or k == "step":
                continue
            if isinstance(v, torch.Tensor) and hasattr(v, "full_tensor"):
                out[f"v.{n}.{k}"] = v.full_tensor().float()
                continue
            is_q = isinstance(v, QuantizedState)
            val = v.dequantize() if is_q else v.float()
            out[f"v.{n}.{k}"] = _like_param(val.contiguous(), p).full_tensor()
            flags = [None] * S.WORLD
            dist.all_gather_object(flags, is_q)
            coded[f"{n}.{k}"] = flags
            if all(flags):
                wc, ws = _code_widths(v.shape, v.fmt)
                rows = codes_by_row(v).contiguous()
                out[f"codes.{n}.{k}"] = _by_rows(rows, p, wc).full_tensor()
                scale = v.scale.view(rows.shape[0], ws)
                out[f"scale.{n}.{k}"] = _by_rows(scale, p, ws).full_tensor()
        if p in comps:
            out[f"c.{n}"] = _like_param(comps[p], p).full_tensor().float()
    # on one rank full_tensor() may be the local tensor itself, which the next steps change
    return {k: v.clone() for k, v in out.items()}, coded


def compare(ref: dict, here: dict) -> dict:
    """Per key: 0.0 where bit for bit equal, else the largest absolute difference (relative to
    the largest reference magnitude under ``rel``); keys on one side only are listed."""
    diff, rel = {}, {}
    for k in sorted(set(ref) & set(here)):
        a, b = ref[k], here[k]
        if a.dtype == torch.uint8:  # codes: the share of bytes that differ
            diff[k] = 0.0 if torch.equal(a, b) else float((a != b).float().mean())
            continue
        a, b = a.float(), b.float()
        same = torch.equal(a.view(torch.int32), b.view(torch.int32))
        diff[k] = 0.0 if same else float((a - b).abs().max())
        rel[k] = 0.0 if same else diff[k] / max(float(a.abs().max()), 1e-30)
    return {
        "diff": diff,
        "rel": rel,
        "only_saved": sorted(set(ref) - set(here)),
        "only_here": sorted(set(here) - set(ref)),
    }


def save(root: Path, cases: list[str]) -> None:
    root = root / f"from{S.WORLD}"
    root.mkdir(parents=True, exist_ok=True)
    for case in cases:
        recipe, width = CASES[case]
        for mode in MODES:
            model, opt = build(recipe, width, 0)
            losses = [step(model, opt, i, mode) for i in range(SAVE_AT)]
            mpd.save_checkpoint(str(root / f"ckpt_{case}_{mode}"), model, opt)
            at_load, coded = gathered_state(model, opt)
            losses += [step(model, opt, i, mode) for i in range(SAVE_AT, STEPS)]
            after, _ = gathered_state(model, opt)
            if S.RANK == 0:
                ref = {"at_load": at_load, "after": after, "losses": losses, "coded": coded}
                torch.save(ref, root / f"ref_{case}_{mode}.pt")
    dist.barrier()


def load(root: Path, cases: list[str]) -> dict:
    out = {}
    for case in cases:
        recipe, width = CASES[case]
        for mode in MODES:
            ref = torch.load(root / f"ref_{case}_{mode}.pt", weights_only=True)
            model, opt = build(recipe, width, 7)
            mpd.load_checkpoint(str(root / f"ckpt_{case}_{mode}"), model, opt)
            at_load, coded = gathered_state(model, opt)
            losses = [step(model, opt, i, mode) for i in range(SAVE_AT, STEPS)]
            after, _ = gathered_state(model, opt)
            out[f"{case}/{mode}"] = {
                "at_load": compare(ref["at_load"], at_load),
                "after": compare(ref["after"], after),
                "losses_saved": ref["losses"][SAVE_AT:],
                "losses": losses,
                "loss_diff": max(abs(a - b) for a, b in zip(ref["losses"][SAVE_AT:], losses)),
                "coded_saved": ref["coded"],
                "coded_here": coded,
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--saved-by", type=int, default=2, help="load: the world size that saved")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--save-cases", help="save: these cases (default: --cases)")
    ap.add_argument("phases", nargs="+", choices=("save", "load"), help="run in this order")
    args = ap.parse_args()
    cases = args.cases.split(",")
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    S.RANK, S.WORLD = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    for phase in args.phases:  # one launch for both: 4 gloo ranks start slowly on 2 cores
        if phase == "save":
            save(root, args.save_cases.split(",") if args.save_cases else cases)
        else:
            res = load(root / f"from{args.saved_by}", cases)
            if S.RANK == 0:
                (root / f"from{args.saved_by}" / f"load_{S.WORLD}.json").write_text(json.dumps(res))
    S.shutdown()


if __name__ == "__main__":
    main()
