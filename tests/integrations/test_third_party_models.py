"""Real third-party models through mixprec: Hugging Face transformers built from small configs
(random weights, nothing downloaded) trained at O1 and O2, and a Hugging Face BERT sentence
encoder (all-MiniLM-L6-v2's pipeline: mean pooling, L2 norm) that the test trains for a few
seconds, contrastively, so that its embeddings spread, then runs in bf16."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
from extras import need

import mixprec
from mixprec.inference.bench_workloads import byte_tokens

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = need("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STEPS = 6


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 97, (4, 16))
    return model, dict(input_ids=ids, labels=ids), "logits"


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg)
    return (
        model,
        dict(
            input_ids=torch.randint(0, 97, (8, 12)),
            attention_mask=torch.ones(8, 12, dtype=torch.long),
            labels=torch.randint(0, 3, (8,)),
        ),
        "logits",
    )


def _t5():
    cfg = transformers.T5Config(
        vocab_size=97,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg)
    return (
        model,
        dict(input_ids=torch.randint(1, 97, (4, 12)), labels=torch.randint(1, 97, (4, 8))),
        "logits",
    )


MODELS = {"gpt2-lm": _gpt2, "bert-classifier": _bert, "t5-encoder-decoder": _t5}


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_trains(name, level):
    model, batch, out_key = MODELS[name]()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = mixprec.initialize(model, opt, level, torch.bfloat16)
    if level == "O2":
        assert any(p.dtype == torch.bfloat16 for p in model.parameters())
    losses = []
    for _ in range(STEPS):
        out = model(**batch)
        assert out.loss.dtype == torch.float32 and out[out_key].dtype == torch.float32
        assert torch.isfinite(out.loss)
        losses.append(float(out.loss))
        opt.backward(out.loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    assert opt.skipped_steps == 0
    assert losses[-1] < losses[0] * 0.9, losses


SENTENCES = [
    "Mixed precision keeps the risky operations in float32.",
    "The loss scale doubles after two thousand finite steps.",
    "A cat sat on the warm windowsill all afternoon.",
    "bfloat16 has the exponent range of float32 with fewer mantissa bits.",
    "Gradient overflow: skipping step and reducing the loss scale.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Paris is the capital of France.",
    "Transformers compute attention with a softmax over scaled dot products.",
]
_SUBJECTS = ["The cat", "A pilot", "My neighbour", "The old engine", "Our teacher", "The river"]
_VERBS = ["sleeps", "flies", "sings", "breaks down", "explains fractions", "floods the valley"]
_WHEN = ["every morning.", "at night.", "in the rain.", "after lunch.", "on Sundays."]
CORPUS = [f"{s} {v} {w}" for s in _SUBJECTS for v in _VERBS for w in _WHEN]


def embed(model, sentences):
    """sentence-transformers' pipeline: mean pooling over tokens, then L2 normalization."""
    ids, mask = byte_tokens(sentences, max_len=80)  # [CLS]=101, [SEP]=102, byte b=1000+b
    enc = {"input_ids": ids, "attention_mask": mask}
    hidden = model(**enc).last_hidden_state.float()
    mask = enc["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


@functools.cache
def sentence_encoder(steps: int = 25, batch: int = 16):
    """A 2-layer BERT on UTF-8 bytes, trained ``steps`` steps with unsupervised SimCSE (two
    dropout views of each sentence; the other sentences of the batch are the negatives), from a
    fixed seed. Untrained, it embeds every sentence alike (pairwise cosine >= 0.96 on
    SENTENCES; trained: down to -0.08), and a similarity check on it could not fail."""
    cfg = transformers.BertConfig(
        vocab_size=1256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=80,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(cfg, add_pooling_layer=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(steps):
        chunk = [CORPUS[j] for j in torch.randperm(len(CORPUS))[:batch]]
        a, b = embed(model, chunk), embed(model, chunk)
        loss = torch.nn.functional.cross_entropy(a @ b.T / 0.05, torch.arange(len(chunk)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def encoder_cosines(level: str = "O3") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 pair similarities, per-sentence cosine of bf16 mixprec embeddings to fp32 ones, and
    the largest change of a pair similarity."""
    model = sentence_encoder()
    with torch.no_grad():
        ref = embed(model, SENTENCES)
        low = mixprec.initialize(copy.deepcopy(model), recipe=level, dtype=torch.bfloat16)
        got = embed(low, SENTENCES)
    return ref @ ref.T, (ref * got).sum(-1), (ref @ ref.T - got @ got.T).abs().max()


def test_trained_sentence_encoder_bf16_embeddings_match_fp32():
    sim, cos, sim_err = encoder_cosines("O3")
    print(
        f"\nsentence encoder bf16 (O3) vs fp32: cosine min {cos.min():.5f} "
        f"mean {cos.mean():.5f}; max |similarity difference| {sim_err:.4f}"
    )
    assert sim.min() < 0.5  # the embeddings spread: a similarity check can fail
    assert cos.min() > 0.999
    assert sim_err < 0.03  # the pairwise similarities users rank by barely move
