"""``mixprec report`` on the built-in model and on a user's ``module:factory``."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from mixprec.cli import main

pytestmark = pytest.mark.filterwarnings("ignore")


def test_report_on_the_builtin_model_writes_table_json_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["report", "--steps", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "op statistics" in out and "TOTAL" in out and "range audit" in out
    assert "no inf/NaN in 1 step(s)" in out
    doc = json.loads((tmp_path / "report.json").read_text())
    assert set(doc) >= {"lint", "op_stats", "range_audit", "locator"}
    assert doc["op_stats"]["forward"]["addmm"]["bf16"] > 0
    for kind in ("gradient", "activation"):
        assert (tmp_path / f"range_{kind}.png").read_bytes()[:4] == b"\x89PNG"


def test_report_on_a_user_factory_with_tune(tmp_path, capsys, monkeypatch):
    (tmp_path / "user_models.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        def make():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(12, 30), nn.ReLU(), nn.Linear(30, 3))
            x = torch.randn(16, 12)
            return model, (x, torch.randint(0, 3, (16,)))

        def bare():
            return nn.Linear(5, 5)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out_dir = tmp_path / "out"
    assert (
        main(
            [
                "report",
                "user_models:make",
                "--steps",
                "1",
                "--tune",
                "--no-plots",
                "--out",
                str(out_dir),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "in_features=12" in out and "out_features=30" in out  # the lint ran on it
    doc = json.loads((out_dir / "report.json").read_text())
    assert doc["tune"]["passed"] and doc["tune"]["policies"] == {}
    assert not list(out_dir.glob("*.png"))
    assert main(["report", "user_models:bare", "--out", str(out_dir)]) == 0
    assert "need (model, batch)" in capsys.readouterr().out
    assert main(["report", "user_models", "--out", str(out_dir)]) == 2
    assert "module:factory" in capsys.readouterr().err
    sys.modules.pop("user_models", None)


def test_report_finds_a_module_in_the_current_folder(tmp_path, capsys, monkeypatch):
    # the `mixprec` console script does not put the current folder on sys.path (python -m does)
    (tmp_path / "mymodel.py").write_text(
        textwrap.dedent("""
        from torch import nn

        def factory():
            return nn.Linear(4, 4)
    """)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "mymodel", raising=False)
    assert main(["report", "mymodel:factory", "--no-plots", "--out", str(tmp_path / "o")]) == 0
    assert "need (model, batch)" in capsys.readouterr().out
    sys.modules.pop("mymodel", None)
