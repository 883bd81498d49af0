"""Fine-tune a Hugging Face model with ``transformers.Trainer`` at a mixprec level.

A BERT-style classifier built from a small config (random weights: nothing is downloaded)
learns a toy task with ``MixprecTrainer``, a ``Trainer`` subclass that routes the optimizer and
the backward through mixprec. Keep ``fp16``/``bf16`` off in ``TrainingArguments``.

    HF_HUB_OFFLINE=1 python examples/hf_trainer.py
"""

from __future__ import annotations

import os
import tempfile

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers

from mixprec.integrations.huggingface import MixprecTrainer


class ToyTask(torch.utils.data.Dataset):
    """Label = whether token 7 appears in the sequence."""

    def __init__(self, n: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(8, 97, (n, 12), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.ids[self.labels == 1, 3] = 7

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones(12, dtype=torch.long),
            "labels": self.labels[i],
        }


def train(
    level: str = "O2",
    dtype: torch.dtype = torch.bfloat16,
    steps: int = 30,
    output_dir: str | None = None,
) -> tuple[MixprecTrainer, list[float]]:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
    )
    model = transformers.BertForSequenceClassification(cfg)
    args = transformers.TrainingArguments(
        output_dir=output_dir or tempfile.mkdtemp(),
        max_steps=steps,
        per_device_train_batch_size=32,
        learning_rate=3e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        max_grad_norm=1.0,
        disable_tqdm=True,
    )
    trainer = MixprecTrainer(
        model=model, args=args, train_dataset=ToyTask(), mixprec_recipe=level, mixprec_dtype=dtype
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses


if __name__ == "__main__":
    trainer, losses = train()
    print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; skipped steps "
        f"{trainer.mixprec_optimizer.skipped_steps}"
    )
