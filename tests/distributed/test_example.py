"""examples/torchrun_fsdp.py as a user runs it: "lean" on FSDP2 over 2 gloo ranks, saved,
resumed in fresh processes, exported to a plain fp32 model (live and offline)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mixprec.bench.models import GPT

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "torchrun_fsdp.py"

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def _run(tmp: Path, *args: str) -> str:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    run = subprocess.run(
        [*cmd, str(EXAMPLE), *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


def _losses(out: str) -> dict[int, str]:
    return {int(s): loss for s, loss in re.findall(r"step +(\d+)  loss (\S+)", out)}


def test_lean_on_fsdp2_resumes_bit_for_bit_and_exports_a_plain_fp32_model(tmp_path):
    whole = _run(tmp_path, "--steps", "8", "--checkpoint", "whole")
    _run(tmp_path, "--steps", "4", "--checkpoint", "part")
    resumed = _run(tmp_path, "--steps", "8", "--checkpoint", "part", "--resume")
    assert sorted(_losses(resumed)) == [4, 5, 6, 7]  # the resumed run starts where it stopped
    assert {s: _losses(whole)[s] for s in range(4, 8)} == _losses(resumed)  # printed with repr
    assert float(_losses(whole)[7]) < float(_losses(whole)[0])
    exported = [re.search(r"plain fp32 model .*: loss (\S+)", o).group(1) for o in (whole, resumed)]
    assert exported[0] == exported[1]
    a, b = (torch.load(tmp_path / f, weights_only=True) for f in ("whole_fp32.pt", "part_fp32.pt"))
    assert a.keys() == b.keys() and all(v.dtype == torch.float32 for v in a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
    GPT(_example_config()).load_state_dict(a)  # the model built without mixprec
    # offline, as the example's docstring shows: the saved directory gives the same dict
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from mixprec.distributed import fp32_state_dict_from_checkpoint

    dcp_to_torch_save(tmp_path / "whole", tmp_path / "whole.pt")
    offline = fp32_state_dict_from_checkpoint(tmp_path / "whole.pt")
    assert offline.keys() == a.keys()
    assert all(torch.equal(offline[k].view(torch.int32), a[k].view(torch.int32)) for k in a)


def _example_config():
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import torchrun_fsdp
    finally:
        sys.path.pop(0)
    return torchrun_fsdp.CONFIG
