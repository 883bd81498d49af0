"""FSDP2 checkpoints loaded under another recipe, on 2 ranks (gloo, CPU); for
``test_cross_recipe_fsdp.py`` beside it.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 \\
        tests/distributed/cross_recipe.py --out DIR

Per pair of :data:`PAIRS`: the source recipe trains 4 steps and saves; the target recipe builds
the model from another seed, loads, and each rank checks its own shards against the rule each
state is carried by (computed here from the saved run's shards, independently of mixprec's
code); then 8 steps on one batch. Every rank writes ``DIR/rank{r}.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scenarios as S

import mixprec.distributed as mpd
from mixprec import Recipe

BF16 = torch.bfloat16
RECIPES = {
    "O2": Recipe("O2", BF16),
    "O3": Recipe("O3", BF16),  # fp32 master shards as well under FSDP2
    "kahan": Recipe("O3", BF16, update="kahan"),
    "lean": Recipe("lean", BF16),
    "lean_4bit": Recipe("lean", BF16, optimizer_states="4-bit"),
}
PAIRS = [
    ("O2", "lean"),
    ("O2", "kahan"),
    ("kahan", "lean"),
    ("lean", "O2"),
    ("kahan", "O2"),
    ("lean", "kahan"),
    ("O2", "O3"),
    ("lean", "lean_4bit"),
]


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def snapshot(model, opt) -> dict:
    """This rank's shards: weights, compensation and every state's fp32 value (codes decoded),
    with the raw codes and scales, by parameter name."""
    out = {}
    comps = {} if opt.updater is None else opt.updater.compensation
    for name, p in model.named_parameters():
        st = {}
        for k, v in opt.optimizer.state.get(p, {}).items():
            if hasattr(v, "codes"):
                st[k] = (v.dequantize(), v.codes.clone(), v.scale.clone())
            elif isinstance(v, torch.Tensor):
                st[k] = (_local(v).detach().clone(), None, None)
        c = comps.get(p)
        out[name] = {
            "w": _local(p).detach().clone(),
            "c": None if c is None else c.clone(),
            "st": st,
        }
    return out


def expected_weight(saved: dict, p_dtype, has_comp: bool) -> tuple:
    """(weight, compensation) by the rules, from the saved shard (written out here)."""
    w, c = saved["w"], saved["c"]
    if p_dtype == torch.float32:  # into an fp32 master shard: w (+ c), exactly
        return (w.float() if c is None else w.float() + c.float()), None
    if w.dtype == torch.float32:  # a master into a 16-bit weight: nearest, remainder
        new = w.to(p_dtype)
        return new, ((w - new.float()).to(p_dtype) if has_comp else None)
    if c is not None and not has_comp:  # folded into the weight
        return (w.float() + c.float()).to(p_dtype), None
    return w, (c if c is not None else torch.zeros_like(w)) if has_comp else None


def compare(before: dict, after: dict, dst: str) -> dict:
    """Per rank: which rules held bit for bit after the load."""
    weights_exact = comps_exact = states_exact = codes_kept = True
    for name, a in after.items():
        b = before[name]
        w, c = expected_weight(b, a["w"].dtype, a["c"] is not None)
        weights_exact &= a["w"].dtype == w.dtype and torch.equal(a["w"], w)
        if a["c"] is not None:
            comps_exact &= torch.equal(a["c"], c)
        for k, (value, codes, scale) in b["st"].items():
            got = a["st"].get(k)
            if got is None:
                states_exact = False
                continue
            states_exact &= torch.equal(got[0].float(), value.float())  # the values, as saved
            if codes is not None and RECIPES[dst].update not in ("auto", None):
                codes_kept &= got[1] is not None and torch.equal(got[1], codes)
                codes_kept &= torch.equal(got[2], scale)
    return {
        "weights_exact": bool(weights_exact),
        "comps_exact": bool(comps_exact),
        "states_exact": bool(states_exact),
        "codes_kept": bool(codes_kept),
        "coded_saved": sum(s[1] is not None for b in before.values() for s in b["st"].values()),
        "state_dtypes": sorted(
            {f"{k}:{s[0].dtype}" for a in after.values() for k, s in a["st"].items()}
        ),
    }


def _train(model, opt, steps: int, same: bool) -> list[float]:
    losses = []
    for i in range(steps):
        x, y = S.dcp_batch(0 if same else i)
        loss = S.mse(model, S.local(x), S.local(y))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / S.WORLD)
    return losses


def pair(src: str, dst: str, root: Path) -> dict:
    path = root / f"{src}_to_{dst}"
    model, opt = S._dcp_build(RECIPES[src], 0)
    _train(model, opt, 4, same=False)
    mpd.save_checkpoint(path, model, opt)
    before = snapshot(model, opt)
    saved_steps = None if opt.updater is None else opt.updater.steps
    model, opt = S._dcp_build(RECIPES[dst], 7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mpd.load_checkpoint(path, model, opt)
    out = compare(before, snapshot(model, opt), dst)
    said = [str(w.message) for w in caught if "another recipe" in str(w.message)]
    out.update(
        report=opt.last_load_report,
        warnings=said,
        warned_at=[Path(w.filename).name for w in caught if "another recipe" in str(w.message)],
        steps=None if opt.updater is None else opt.updater.steps,
        saved_steps=saved_steps,
        losses=_train(model, opt, 8, same=True),
    )
    out["coded_after"] = sum(  # stored as the target recipe stores them once it stepped
        hasattr(v, "codes") for st in opt.optimizer.state.values() for v in st.values()
    )
    weights = S.flat(p.full_tensor().float() for p in model.parameters())
    out["ranks_equal"] = all(S.bitwise_equal(weights, o) for o in S.gathered(weights))
    return out


def refused(root: Path) -> dict:
    """What still cannot be carried: another 16-bit dtype and another number of losses."""
    path = root / "refused_o2"
    model, opt = S._dcp_build(RECIPES["O2"], 0)
    _train(model, opt, 1, same=False)
    mpd.save_checkpoint(path, model, opt)
    out = {}
    for name, recipe in {
        "dtype": Recipe("lean", torch.float16),
        "num_losses": Recipe("lean", BF16, num_losses=2),
    }.items():
        model, opt = S._dcp_build(recipe, 7)
        before = S._local_state(model, opt)
        out[name] = {
            "error": S._refused(lambda m=model, o=opt: mpd.load_checkpoint(path, m, o)),
            "unchanged": S.bitwise_equal(before, S._local_state(model, opt)),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    S.RANK, S.WORLD = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    shared = [tempfile.mkdtemp(prefix="mixprec_cross_") if S.RANK == 0 else None]
    dist.broadcast_object_list(shared)
    root = Path(shared[0])
    results = {}
    jobs = {f"{a}->{b}": (lambda a=a, b=b: pair(a, b, root)) for a, b in PAIRS}
    jobs["refused"] = lambda: refused(root)
    for name, job in jobs.items():
        try:
            results[name] = job()
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            results[name] = {"error": traceback.format_exc()}
            print(f"[rank {S.RANK}] {name} failed:\n{results[name]['error']}", file=sys.stderr)
        dist.barrier()
    Path(args.out, f"rank{S.RANK}.json").write_text(json.dumps(results, indent=1))
    if S.RANK == 0:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    os.environ.pop("MIXPREC_DIST_TMP", None)
    S.shutdown()


if __name__ == "__main__":
    sys.exit(main())
