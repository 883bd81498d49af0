"""Train a small LightningModule with mixprec's O2 level through the Lightning precision plugin.

python examples/lightning_mixprec.py            # bf16 O2 on CPU; fp16 with --dtype float16
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

from mixprec.integrations.lightning import MixprecPrecision


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)  # calls a submodule: the plugin's region casts
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)]


def data(n: int = 512, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    y = x[:, :4].argmax(-1)
    return torch.utils.data.TensorDataset(x, y)


def train(
    recipe: str = "O2", dtype: torch.dtype = torch.bfloat16, steps: int = 20
) -> tuple[Classifier, MixprecPrecision]:
    torch.manual_seed(0)
    model = Classifier()
    plugin = MixprecPrecision(recipe, dtype)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
    )
    loader = torch.utils.data.DataLoader(data(), batch_size=64, shuffle=True)
    trainer.fit(model, loader)
    return model, plugin


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--level", default="O2")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    model, plugin = train(args.level, getattr(torch, args.dtype))
    print(
        f"loss {model.losses[0]:.3f} -> {model.losses[-1]:.3f}; loss scale "
        f"{plugin.optimizers[0].loss_scale}; skipped {plugin.optimizers[0].skipped_steps}"
    )
