"""Level names fold case wherever a level is named ("o2" is "O2"), and a wrong name is refused
with every valid spelling: initialize, the Apex shim, the Lightning plugin and the CLI."""

from __future__ import annotations

import pytest
import torch
from extras import has, install_hint
from torch import nn

import mixprec
from mixprec._initialize import level_name
from mixprec.cli import main

BF16 = torch.bfloat16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))


@pytest.mark.parametrize("spelling", ["o2", "O2"])
def test_initialize_takes_a_level_in_either_case(spelling):
    model = _model()
    model, opt = mixprec.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), spelling, BF16
    )
    assert model[0].weight.dtype == BF16 and model[1].weight.dtype == torch.float32  # O2
    assert opt.master_params()[0].dtype == torch.float32


@pytest.mark.parametrize("bad", ["O4", "02", "o", "", 2, None])
def test_a_wrong_level_name_lists_the_spellings(bad):
    with pytest.raises(ValueError, match=r"expected 'O0', 'O1', 'O2' or 'O3' \(the letter O, not"):
        level_name(bad)
    if isinstance(bad, str):
        with pytest.raises(
            ValueError, match=r"expected 'O0', 'O1', 'O2' or 'O3' \(the letter O, not zero.*bf16"
        ):
            mixprec.initialize(_model(), recipe=bad, dtype=BF16)
        with pytest.raises(ValueError, match=r"Unknown recipe name .*the letter O, not zero"):
            mixprec.Recipe(bad, BF16)
    else:  # not a name at all
        with pytest.raises(TypeError, match=r"Expected a mixprec.Recipe, a recipe name \(O0, O1"):
            mixprec.initialize(_model(), recipe=bad, dtype=BF16)


def test_level_name_maps_every_case_to_the_key():
    assert [level_name(n) for n in ("o0", "O1", "o2", "O3")] == ["O0", "O1", "O2", "O3"]


def test_apex_shim_folds_opt_level_case_and_keeps_apexs_error():
    from mixprec.compat.apex import amp

    amp.reset()
    try:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="o2", verbosity=0)
        assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32
        with pytest.raises(RuntimeError, match=r"Unexpected optimization level '02'.*any case"):
            amp.initialize(_model(), opt_level="02", verbosity=0)
    finally:
        amp.reset()  # the shim's process-wide state must not reach the next test


def test_lightning_plugin_folds_level_case():
    if not has("lightning", "pytorch_lightning"):
        pytest.skip(install_hint("pytorch_lightning"))
    from mixprec.integrations.lightning import MixprecPrecision

    assert MixprecPrecision("o0").level == "O0"
    assert MixprecPrecision("o0").precision == "32-true"
    with pytest.raises(ValueError, match="expected 'O0'"):
        MixprecPrecision("O5")


def test_demo_levels_fold_case_and_refuse_with_the_spellings(capsys):
    with pytest.raises(SystemExit):  # parsed: o0 o2 are levels; then --steps 1 is refused
        main(["demo", "--levels", "o0", "o2", "--steps", "1"])
    assert "--steps must be at least 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--levels", "O0", "02"])
    err = capsys.readouterr().err
    assert "argument --levels: Unknown level '02'" in err and "'o2' is 'O2'" in err


def test_bench_modes_fold_case(capsys):
    with pytest.raises(SystemExit):  # parsed: o2 is the mode O2; then the bad workload is refused
        main(["bench", "nope", "--modes", "fp32", "o2"])
    assert "unknown workload(s) ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--modes", "o9"])
    assert "invalid choice: 'o9'" in capsys.readouterr().err
