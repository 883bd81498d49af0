"""Launching the 2-process scenarios of this folder (torchrun, gloo, CPU) and reading what each
rank wrote: shared by the test modules beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240  # one whole launch; ~15-70 s on the shared 2-core machine


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run`` on ``nproc`` ranks, one thread each, with this
    checkout first on the workers' path."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def rank_results(worker: Path, out: Path, nproc: int = 2) -> list[dict]:
    """Run ``worker --out out`` on ``nproc`` ranks; each rank's ``rank{r}.json``."""
    proc = torchrun(nproc, str(worker), "--out", str(out))
    files = [out / f"rank{r}.json" for r in range(nproc)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        pytest.fail(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads(f.read_text()) for f in files]


def result(ranks: list[dict], name: str) -> list[dict]:
    """Each rank's result of scenario ``name``, failing on a rank that raised."""
    per_rank = [r[name] for r in ranks]
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"rank {r}, scenario {name}:\n{res.get('error')}"
    return per_rank
