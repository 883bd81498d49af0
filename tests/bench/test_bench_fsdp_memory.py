"""benchmarks/bench_fsdp_memory.py's per-rank measurement runs on a tiny model, one rank,
in a fresh process without torchrun (the sweep itself launches torchrun and takes minutes)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_fsdp_memory.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["lean"])
def test_rank_child_one_rank_tiny(tmp_path, mode):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, str(SCRIPT), "--rank-child", mode, "--steps", "1",
           "--scale", "0.05", "--out", str(tmp_path)]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, timeout=120, capture_output=True)
    res = json.loads((tmp_path / "rank0.json").read_text())
    assert res["mode"] == mode and res["ranks"] == 1 and res["params"] > 0
    assert res["peak_bytes_per_param"] > 0 and res["peak_mib"] > 0
    assert res["train_mib"] is None or res["train_mib"] <= res["peak_mib"] + 1e-6
