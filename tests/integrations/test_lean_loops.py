"""The "lean" recipe (``gradients="auto"``, bf16) in the loops users have: nanoGPT's train.py
(clipping at 1.0 and accumulation over micro-batches), Hugging Face's Trainer through
``MixprecTrainer`` (``max_grad_norm=1.0`` by default) and Lightning's plugin
(``gradient_clip_val``, ``accumulate_grad_batches``). Where the loop needs every gradient at
once the gradients are coded in 8 bits -- the coded path, bit for bit; held where the loop
clips by value -- and the choice is said in a warning; where it does not they are released
after the first step."""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
import torch.nn.functional as F
from extras import has, install_hint, need
from torch import nn
from training_helpers import TinyGPT, assert_bitwise

import mixprec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BF16 = torch.bfloat16
CODES = "codes the gradients|runs with gradients='coded'"


class GPT(TinyGPT):
    """nanoGPT's shape in miniature, large enough (token embedding 64 x 64, the MLP) for 8-bit
    state codes."""

    def __init__(self) -> None:
        super().__init__(vocab=64, n_embd=64, block=8)


def nanogpt(recipe, grad_accum=2, grad_clip=1.0, iters=6):
    """nanoGPT's train.py loop on CPU, with only mixprec's initialize line added: bf16 (the
    GradScaler disabled), ``loss / grad_accum`` over micro-batches, ``clip_grad_norm_`` when
    ``grad_clip``, the LR set on every group each iteration, ``zero_grad(set_to_none=True)``."""
    torch.manual_seed(0)
    model = GPT()
    optimizer = model.configure_optimizers(0.1, 3e-3, (0.9, 0.95), "cpu")
    model, optimizer = mixprec.initialize(model, optimizer, recipe, BF16)  # the line added
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # enabled only for float16
    ctx = contextlib.nullcontext()  # nanoGPT's ctx on CPU
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 64, (grad_accum, 4, 9), generator=g)  # (X, Y) per micro-step, fitted
    losses, norms = [], []
    for it in range(iters):
        lr = 1e-2 * min(1.0, (it + 1) / 3)  # warmup
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        total = 0.0
        for micro_step in range(grad_accum):
            X, Y = data[micro_step, :, :-1], data[micro_step, :, 1:]
            with ctx:
                _, loss = model(X, Y)
                loss = loss / grad_accum
            scaler.scale(loss).backward()
            total += loss.item()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return model, optimizer, losses, norms


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("grad_accum", "grad_clip"), [(2, 1.0), (1, 1.0), (2, 0.0), (1, 0.0)])
def test_nanogpt_loop_runs_lean_as_coded_bit_for_bit(grad_accum, grad_clip):
    """Clip every step, accumulate over micro-batches, both, neither: "lean" trains. Its first
    step codes the gradients as they complete; a loop that clips or accumulates keeps them
    coded (said once), and its trajectory is the explicitly coded one, bit for bit; one that
    does neither releases them after that first step, which is the coded one's."""
    needs = grad_clip != 0.0 or grad_accum > 1
    with pytest.warns(UserWarning, match=CODES) if needs else contextlib.nullcontext():
        model, opt, losses, norms = nanogpt("lean", grad_accum, grad_clip)
    steps = 6 if needs else 1
    coded, _, coded_losses, coded_norms = nanogpt(
        mixprec.Recipe("lean", gradients="coded"), grad_accum, grad_clip, iters=steps
    )
    assert (opt.updater.gradients == "released") == (not needs) and opt.updater.asked == "auto"
    assert (opt.updater.gradients == "coded") == needs
    assert all(p.dtype == BF16 for p in model.parameters())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert losses[:steps] == coded_losses and norms[:steps] == coded_norms
    if needs:
        for p, q in zip(_weights(model), _weights(coded)):
            assert_bitwise(p, q)
    else:
        first, _, _, _ = nanogpt("lean", grad_accum, grad_clip, iters=1)
        for p, q in zip(_weights(first), _weights(coded)):
            assert_bitwise(p, q)
    if grad_clip:
        assert max(norms) > grad_clip  # the clip had work to do
        _, _, unclipped, _ = nanogpt(mixprec.Recipe("lean", gradients="coded"), grad_accum, 0.0)
        assert unclipped != losses  # and it changed the trajectory


def test_nanogpt_loop_with_released_gradients_still_refuses_the_clip():
    """An explicit gradients='released' is kept: the clip raises, naming the fix."""
    with pytest.raises(RuntimeError, match="released in backward.*gradients='held'"):
        nanogpt(mixprec.Recipe("lean", gradients="released"), grad_accum=1)


# -- Hugging Face Trainer ----------------------------------------------------------------------


def _hf(recipe, **args):
    transformers = pytest.importorskip("transformers", reason=install_hint("transformers"))
    from mixprec.integrations.huggingface import MixprecTrainer

    hf_trainer = pytest.importorskip("hf_trainer_example")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=2,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(cfg)
    targs = transformers.TrainingArguments(
        output_dir=args.pop("output_dir"), max_steps=4, per_device_train_batch_size=32,
        learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, **args,
    )  # fmt: skip
    trainer = MixprecTrainer(
        model=model, args=targs, train_dataset=hf_trainer.ToyTask(), mixprec_recipe=recipe,
        mixprec_dtype=BF16,
    )  # fmt: skip
    trainer.train()
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    norms = [h["grad_norm"] for h in history if "grad_norm" in h]
    return trainer, losses, norms


@pytest.fixture
def hf_example(monkeypatch):
    if not (has("transformers") and has("accelerate")):
        pytest.skip(install_hint("transformers"))
    examples = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(
        "hf_trainer_example", os.path.join(examples, "hf_trainer.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "hf_trainer_example", module)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_mixprec_trainer_runs_lean_with_its_default_clipping(hf_example, tmp_path):
    """Trainer's default max_grad_norm=1.0 with mixprec_recipe="lean": the gradients are coded
    (said up front), the run is the explicitly coded one bit for bit, and the logged norm is the
    pre-clip one. With max_grad_norm=0 they are released and no norm is logged."""
    with pytest.warns(UserWarning, match="MixprecTrainer.*gradients='coded'.*max_grad_norm=1.0"):
        trainer, losses, norms = _hf("lean", output_dir=str(tmp_path / "a"))
    held, held_losses, held_norms = _hf(
        mixprec.Recipe("lean", gradients="coded"), output_dir=str(tmp_path / "b")
    )
    opt = trainer.mixprec_optimizer
    assert opt.updater.asked == "coded" and opt.updater.gradients == "coded"
    layer = trainer.model.bert.encoder.layer[0].attention.self.query.weight
    assert layer.dtype == BF16
    assert all(math.isfinite(v) for v in losses) and min(losses[1:]) < losses[0]
    assert losses == held_losses and norms == held_norms and len(norms) == 4
    assert all(0 < n < math.inf for n in norms)
    for p, q in zip(trainer.model.parameters(), held.model.parameters()):
        assert_bitwise(p.detach(), q.detach())
    released, free_losses, free_norms = _hf(
        "lean", output_dir=str(tmp_path / "c"), max_grad_norm=0.0
    )
    assert released.mixprec_optimizer.updater.gradients == "released"
    assert free_norms == [] and len(free_losses) == 4 and all(map(math.isfinite, free_losses))


def _sft(recipe, output_dir):
    """TRL's SFTTrainer with MixprecTrainer in front (SFTConfig's own bf16=True turned off: mixprec
    does the precision), a 2-layer GPT-2 and a character tokenizer made here (nothing
    downloaded), Trainer's default clip (1.0) and 2 micro-batches."""
    need("trl")
    datasets, tokenizers = need("datasets"), need("tokenizers")
    import transformers
    from trl import SFTConfig, SFTTrainer

    from mixprec.integrations.huggingface import MixprecTrainer

    chars = sorted(set("abcdefghijklmnopqrstuvwxyz .,"))
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>"
    )
    texts = ["the quick brown fox jumps over the lazy dog. " * 3, "pack my box with jugs. " * 5]
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(vocab), n_positions=160, n_embd=64, n_layer=2, n_head=2,
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    ))  # fmt: skip
    args = SFTConfig(
        output_dir=output_dir, max_steps=8, per_device_train_batch_size=8, learning_rate=3e-3,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
        max_length=160, gradient_accumulation_steps=2, bf16=False,
    )  # fmt: skip

    class LeanSFT(MixprecTrainer, SFTTrainer):
        pass

    trainer = LeanSFT(
        model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": texts * 32}),
        processing_class=tokenizer, mixprec_recipe=recipe, mixprec_dtype=BF16,
    )  # fmt: skip
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_trl_sft_trainer_composed_with_mixprec_trainer_trains_lean(tmp_path):
    """SFTTrainer's loop (its tokenizing, masking and loss) under "lean": bf16 weights,
    gradients coded for the clip and the accumulation (said up front), losses falling; bit for
    bit the explicitly coded run."""
    with pytest.warns(UserWarning, match="MixprecTrainer.*gradients='coded'"):
        trainer, losses = _sft("lean", str(tmp_path / "a"))
    coded, coded_losses = _sft(mixprec.Recipe("lean", gradients="coded"), str(tmp_path / "b"))
    assert trainer.mixprec_optimizer.updater.gradients == "coded"
    assert {p.dtype for p in trainer.model.parameters()} == {BF16}
    assert len(losses) == 8 and all(map(math.isfinite, losses)) and losses[-1] < 0.8 * losses[0]
    assert losses == coded_losses
    for p, q in zip(trainer.model.parameters(), coded.model.parameters()):
        assert_bitwise(p.detach(), q.detach())


# -- Lightning ---------------------------------------------------------------------------------


def _lightning(recipe, **trainer_args):
    if not has("lightning", "pytorch_lightning"):
        pytest.skip(install_hint("pytorch_lightning"))
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    from mixprec.integrations.lightning import MixprecPrecision

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(20, 128), nn.GELU(), nn.Linear(128, 64),
                                     nn.LayerNorm(64), nn.Linear(64, 4))  # fmt: skip
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    model = Classifier()
    plugin = MixprecPrecision(recipe, BF16)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=6, plugins=[plugin], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **trainer_args,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x = torch.randn(384, 20, generator=g)
    data = torch.utils.data.TensorDataset(x, x[:, :4].argmax(-1))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=32))
    return model, plugin.optimizers[0]


@pytest.mark.filterwarnings("ignore::UserWarning:lightning")
@pytest.mark.filterwarnings("ignore::UserWarning:pytorch_lightning")
def test_lightning_plugin_runs_lean_with_clipping_and_accumulation():
    """gradient_clip_val=1.0 and accumulate_grad_batches=2 with "lean": coded (said up front),
    bit for bit the explicitly coded run; a clip by value holds them, bit for bit the held run;
    Lightning's default (no clipping) releases them."""
    loop = {"gradient_clip_val": 1.0, "accumulate_grad_batches": 2}
    with pytest.warns(UserWarning, match="MixprecPrecision.*'coded'.*gradient_clip_val=1.0.*accu"):
        model, opt = _lightning("lean", **loop)
    held, _ = _lightning(mixprec.Recipe("lean", gradients="coded"), **loop)
    assert opt.updater.asked == "coded"
    assert all(p.dtype == BF16 for p in model.parameters())  # O3: norms in bf16 as well
    assert len(model.losses) == 12 and all(map(math.isfinite, model.losses))
    assert sum(model.losses[-3:]) < sum(model.losses[:3])
    assert model.losses == held.losses
    for p, q in zip(model.parameters(), held.parameters()):
        assert_bitwise(p.detach(), q.detach())
    unclipped, _ = _lightning(mixprec.Recipe("lean", gradients="coded"), accumulate_grad_batches=2)
    assert unclipped.losses != model.losses  # the clip changed the trajectory
    by_value = {**loop, "gradient_clip_algorithm": "value"}
    with pytest.warns(UserWarning, match="MixprecPrecision.*gradients='held'"):
        value, value_opt = _lightning("lean", **by_value)
    held, _ = _lightning(mixprec.Recipe("lean", gradients="held"), **by_value)
    assert value_opt.updater.asked == "held" and value.losses == held.losses
    plain, plain_opt = _lightning("lean")  # Lightning's default: no clipping, no accumulation
    assert plain_opt.updater.gradients == "released" and all(map(math.isfinite, plain.losses))
