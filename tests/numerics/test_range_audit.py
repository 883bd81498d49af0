"""Range audit: fractions match torch.finfo computed directly; histogram; loss scale; plot."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch
from torch import nn

import mixprec
from mixprec.numerics.range_audit import EXP_MIN


def _finfo_fractions(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    fi = torch.finfo(dtype)
    sub = fi.smallest_normal * fi.eps
    a = values.detach().float().flatten().abs()
    a = a[a != 0] * scale
    n = a.numel()
    return {
        "underflow": (a < sub).sum().item() / n,
        "subnormal": ((a >= sub) & (a < fi.smallest_normal)).sum().item() / n,
        "overflow": (a > fi.max).sum().item() / n,
    }


class Spread(nn.Module):
    """A Linear whose output spans 2**-40 .. 2**20: some values underflow, some overflow fp16."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 64)

    def forward(self, x):
        exps = torch.linspace(-40, 20, 64)
        return self.lin(x) * torch.pow(2.0, exps)


def _run(loss_scale=None):
    torch.manual_seed(0)
    model = nn.Sequential(Spread(), nn.Linear(64, 4))
    x = torch.randn(32, 8)
    seen = {}

    def keep(m, a, out):  # returns None: a forward hook's return value replaces the output
        seen.setdefault("act", out.detach())
        out.register_hook(lambda g: seen.__setitem__("grad", g.detach()))

    model[0].register_forward_hook(keep)
    with mixprec.numerics.range_audit(model, ["0", "1"], loss_scale=loss_scale) as audit:
        (model(x) * 2.0**-28).sum().backward()
    return audit, seen


def test_underflow_and_overflow_fractions_match_finfo():
    audit, seen = _run()
    act = audit.stats[("0", "activation")]
    for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        assert act.fractions(name) == pytest.approx(_finfo_fractions(seen["act"], dt), abs=0)
    f = act.fractions("fp16")
    assert f["underflow"] > 0.1 and f["subnormal"] > 0.05 and f["overflow"] > 0.01
    assert act.fractions("bf16")["overflow"] == 0 and act.fractions("bf16")["underflow"] == 0


def test_gradient_fractions_are_judged_at_the_loss_scale():
    audit, seen = _run(loss_scale=1024.0)
    grad = audit.stats[("0", "gradient")]
    assert grad.fractions("fp16") == pytest.approx(
        _finfo_fractions(seen["grad"], torch.float16, 1024.0), abs=0
    )
    unscaled, _ = _run(loss_scale=None)
    assert (
        unscaled.stats[("0", "gradient")].fractions("fp16")["underflow"]
        > grad.fractions("fp16")["underflow"]
    )


def test_histogram_bins_are_floor_log2():
    stats = mixprec.numerics.RangeAudit(nn.Linear(1, 1)).merged()  # empty accumulator
    stats.add(torch.tensor([1.0, 0.75, 2.0**-30, -3.0, 0.0, float("inf")]))
    nz = {EXP_MIN + int(i): int(stats.hist[i]) for i in torch.nonzero(stats.hist).flatten()}
    assert nz == {0: 1, -1: 1, -30: 1, 1: 1}
    assert (stats.zeros, stats.nonfinite, stats.nonzero) == (1, 1, 4)
    assert stats.absmax == 3.0 and stats.absmin == 2.0**-30


def test_recommended_loss_scale_keeps_the_largest_gradient_below_max():
    audit, _seen = _run()
    absmax = audit.merged("gradient").absmax
    s = audit.recommended_loss_scale()
    assert math.log2(s).is_integer()
    assert absmax * s * 2 <= torch.finfo(torch.float16).max < absmax * s * 4 or s in (1.0, 2**24)
    assert audit.recommended_loss_scale(torch.bfloat16) == 1.0


def test_default_modules_summary_dict_and_plot(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with mixprec.numerics.range_audit(model) as audit:
        model(torch.randn(4, 8)).sum().backward()
    assert sorted({m for m, _ in audit.stats}) == ["0", "2"]  # modules owning parameters
    rows = audit.summary()
    assert {r["kind"] for r in rows} == {"activation", "gradient"}
    d = audit.as_dict()
    assert "0:gradient" in d["modules"] and d["recommended_loss_scale_fp16"] >= 1
    assert "range audit" in audit.table()
    pytest.importorskip("matplotlib")
    path = audit.plot(str(tmp_path / "g.png"))
    assert pathlib.Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments():
    with pytest.raises(ValueError, match="No module 'nope'"):
        mixprec.numerics.range_audit(nn.Linear(2, 2), ["nope"])
    with pytest.raises(ValueError, match="loss_scale"):
        mixprec.numerics.range_audit(nn.Linear(2, 2), loss_scale=0)
