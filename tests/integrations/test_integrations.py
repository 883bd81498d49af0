"""Framework integrations train a few steps: the Lightning precision plugin and the Hugging Face
Trainer path (skipped cleanly when the framework is not installed)."""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest
import torch
from extras import has, install_hint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
pytestmark = pytest.mark.filterwarnings("ignore")


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(
    not has("lightning", "pytorch_lightning"), reason=install_hint("pytorch_lightning")
)
@pytest.mark.parametrize(("level", "dtype"), [("O2", torch.bfloat16), ("O1", torch.float16)])
def test_lightning_plugin_trains(level, dtype):
    ex = _example("lightning_mixprec")
    model, plugin = ex.train(level, dtype, steps=12)
    opt = plugin.optimizers[0]
    lin = model.net[0]
    assert lin.weight.dtype == (dtype if level == "O2" else torch.float32)
    assert model.net[1].weight.dtype == torch.float32  # norms stay fp32 at O2
    if level == "O2":
        assert opt.master_params()[0].dtype == torch.float32
    assert all(torch.isfinite(torch.tensor(model.losses)))
    assert sum(model.losses[-3:]) < sum(model.losses[:3])
    if dtype == torch.float16:
        assert opt.loss_scale != 1.0  # dynamic loss scaling ran
    sd = plugin.state_dict()
    assert len(sd["optimizers"][0]["scalers"]) == 1


@pytest.mark.skipif(not has("transformers"), reason=install_hint("transformers"))
@pytest.mark.skipif(not has("accelerate"), reason=install_hint("accelerate"))
def test_hf_trainer_runs_mixprec_level(tmp_path):
    ex = _example("hf_trainer")
    trainer, losses = ex.train("O2", torch.bfloat16, steps=8, output_dir=str(tmp_path))
    model = trainer.model
    assert model.bert.encoder.layer[0].attention.self.query.weight.dtype == torch.bfloat16
    assert model.bert.embeddings.LayerNorm.weight.dtype == torch.float32
    opt = trainer.mixprec_optimizer
    assert opt.skipped_steps == 0 and opt.master_params()[0].dtype == torch.float32
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert norms and all(0 < float(n) < float("inf") for n in norms)  # from the fp32 masters
    assert all(torch.isfinite(torch.tensor(losses))) and min(losses[-3:]) < losses[0]
    # masters were dropped after each step: model.zero_grad() alone cannot leave stale ones
    assert all(
        m.grad is None
        for m in opt.master_params()
        if m.dtype == torch.float32 and any(m is mm for _, mm in opt._pairs)
    )
