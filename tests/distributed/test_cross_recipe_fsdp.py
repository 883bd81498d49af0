"""FSDP2 checkpoints of one recipe loaded under another on 2 ranks: each state carried by the
one-process rule (``mixprec._core.recipe_change``), shard by shard, the change reported, and
training goes on.

One torchrun launch of ``cross_recipe.py`` beside this file (~15 s on 2 shared cores); each rank
checks its own shards against the rules, computed there from the saved run's shards.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch.distributed as dist
from torchrun_helpers import rank_results, result

WORKER = Path(__file__).with_name("cross_recipe.py")
PAIRS = [
    "O2->lean",
    "O2->kahan",
    "kahan->lean",
    "lean->O2",
    "kahan->O2",
    "lean->kahan",
    "O2->O3",
    "lean->lean_4bit",
]
#: the report's lines per pair (the one-process path's words)
REPORTS = {
    "O2->lean": [
        "weights: fp32 masters -> torch.bfloat16 weights (nearest)",
        "update: fp32 masters -> update='stochastic', rounding count from 0",
    ],
    "O2->kahan": [
        "weights: fp32 masters -> torch.bfloat16 weights (nearest)",
        "Kahan compensation: the masters' remainder (master - weight)",
        "update: fp32 masters -> update='kahan', rounding count from 0",
    ],
    "kahan->lean": [
        "update: 'kahan' -> 'stochastic'",
        "Kahan compensation: folded into the weights (weight + compensation, nearest)",
    ],
    "lean->O2": [
        "weights: 16-bit weights -> fp32 masters (exact)",
        "exp_avg: codes -> fp32 (their decoded values)",
        "exp_avg_sq: codes -> fp32 (their decoded values)",
    ],
    "kahan->O2": ["weights: 16-bit weights + compensation -> fp32 masters (exact)"],
    "lean->kahan": ["update: 'stochastic' -> 'kahan'"],
}

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return rank_results(WORKER, tmp_path_factory.mktemp("cross_recipe"))


@pytest.mark.parametrize("pair", PAIRS)
def test_a_checkpoint_loads_under_another_recipe_by_the_rules_and_trains_on(ranks, pair):
    """Right after the load, on each rank: weights by their rule bit for bit (nearest from the
    masters, w (+ c) into fp32 master shards, c folded, or as saved), Kahan compensation the
    remainder / the saved buffer / zero, every optimizer state's value as saved (codes decoded
    bit for bit into fp32 master shards, kept byte for byte under an update mode). Then 8 steps
    on one batch: finite, falling losses, equal weights on both ranks."""
    for res in result(ranks, pair):
        assert res["weights_exact"] and res["comps_exact"], res
        assert res["states_exact"] and res["codes_kept"], res
        assert all(math.isfinite(x) for x in res["losses"])
        assert sum(res["losses"][-3:]) < sum(res["losses"][:3]), res["losses"]
        assert res["ranks_equal"]
        assert len(res["warnings"]) == 1 and res["warned_at"] == ["cross_recipe.py"]
        assert res["warnings"][0].startswith("This checkpoint was saved under another recipe")
        if pair in REPORTS:
            assert res["report"] == REPORTS[pair]
        else:  # no rule changed a value: said so
            assert "every state as saved" in res["report"][0]
        src, dst = pair.split("->")
        if src in ("kahan", "lean") and dst != "O2":  # one update mode into another
            assert res["steps"] == res["saved_steps"] == 4
        if src == "O2" and dst in ("kahan", "lean"):
            assert res["steps"] == 0  # the rounding count starts from 0, as in one process
        if dst.startswith("lean"):
            assert res["coded_after"] > 0  # stored as "lean" stores them once it stepped
        if src == "lean" and dst == "O2":
            assert res["coded_saved"] > 0 and res["coded_after"] == 0


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("dtype", ["dtype: saved torch.bfloat16, here torch.float16"]),
        ("num_losses", ["recipe.num_losses: saved 1, here 2"]),
    ],
)
def test_what_cannot_be_carried_is_refused_with_the_reason_and_the_fix(ranks, case, words):
    for res in result(ranks, "refused"):
        r = res[case]
        assert r["error"].startswith("ValueError: ")
        for w in [*words, "not into another 16-bit dtype", "Prepare the model with"]:
            assert w in r["error"], r["error"]
        assert "Nothing was loaded" in r["error"] and r["unchanged"]
