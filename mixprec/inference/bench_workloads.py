"""The models and data behind ``mixprec infer-bench``: MNIST-1D, the character GPT and an
all-MiniLM-L6-v2 sentence embedder, each with the task metric its variants are judged by.

Design: a workload is ``(fp32 model, timing batch, metric(forward), metric name)``, so
:func:`mixprec.inference.bench.compare_variants` needs to know nothing about where a model came
from. Nothing here downloads: MiniLM's pretrained weights come from a local directory the user
gives, else the architecture runs with random weights and a byte-level tokenizer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.inference.inputs import call_model
from mixprec.inference.prepare import for_inference

WORKLOADS = ("mnist1d-cnn", "char-gpt", "minilm")


#: all-MiniLM-L6-v2's architecture (a BERT encoder) as ``transformers.BertConfig`` fields
MINILM_CONFIG = dict(
    vocab_size=30522,
    hidden_size=384,
    num_hidden_layers=6,
    num_attention_heads=12,
    intermediate_size=1536,
    max_position_embeddings=512,
)


def load_minilm(
    weights: str | None = None, seed: int = 0
) -> tuple[nn.Module, Callable[[Sequence[str]], tuple[torch.Tensor, torch.Tensor]]]:
    """A sentence embedder of all-MiniLM-L6-v2's architecture (BERT, 6 layers, width 384, 12
    heads; mean pooling, L2 norm) and ``encode(sentences) -> (input_ids, attention_mask)``.

    ``weights``: a local Hugging Face directory with the model and its tokenizer (for example
    sentence-transformers/all-MiniLM-L6-v2 saved by the user); nothing is downloaded. Without
    it the weights are random from ``seed`` and the tokenizer is byte-level: latency, sizes and
    what the passes choose are the architecture's, the accuracy columns are not the pretrained
    model's. mixprec ships no weights and depends on no package that does.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers

    if weights is not None:
        bert = transformers.AutoModel.from_pretrained(weights, local_files_only=True)
        tok = transformers.AutoTokenizer.from_pretrained(weights, local_files_only=True)

        def encode(sentences: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
            enc = tok(list(sentences), padding=True, truncation=True, return_tensors="pt")
            return enc["input_ids"], enc["attention_mask"]

        return SentenceEmbedder(bert).eval(), encode
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        bert = transformers.BertModel(
            transformers.BertConfig(**MINILM_CONFIG), add_pooling_layer=False
        )
    return SentenceEmbedder(bert).eval(), byte_tokens


def byte_tokens(sentences: Sequence[str], max_len: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of UTF-8 bytes in BERT's layout: ``[CLS]`` (101), byte
    ``b`` as ``1000 + b``, ``[SEP]`` (102), padding 0 -- a tokenizer that needs no vocabulary."""
    rows = [[101, *(1000 + b for b in s.encode()[: max_len - 2]), 102] for s in sentences]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


class SentenceEmbedder(nn.Module):
    """sentence-transformers' pipeline for all-MiniLM-L6-v2: BERT, mean pooling, L2 norm."""

    def __init__(self, bert: nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        emb = (h * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(emb.float(), dim=-1)


SENTENCES = [
    "Mixed precision keeps matmuls in 16-bit and risky ops in float32.",
    "The quick brown fox jumps over the lazy dog.",
    "ONNX Runtime runs the exported model on the CPU.",
    "A sentence embedding maps text to a unit vector.",
    "Loss scaling keeps small fp16 gradients from underflowing.",
    "Inference chips mix int8 and int16 within one model.",
    "Python's standard library is written mostly in Python.",
    "Batch normalization statistics stay in float32.",
] * 4


def _min_cosine_metric(model: nn.Module, inputs: Any) -> Callable[[Callable[[Any], Any]], float]:
    """``metric(forward)``: the smallest per-row cosine similarity of ``forward(inputs)`` to the
    fp32 ``model``'s output (for sentence embeddings: the worst sentence)."""
    from mixprec.inference.export import _flat_outputs

    with torch.no_grad():
        ref = _flat_outputs(call_model(model, inputs))[0].double()

    def metric(forward: Callable[[Any], Any]) -> float:
        with torch.no_grad():
            out = _flat_outputs(forward(inputs))[0].double()
        return float(torch.nn.functional.cosine_similarity(out, ref, dim=-1).min())

    return metric


def _workload(
    name: str,
    batch: int,
    train_steps: int,
    seed: int,
    *,
    train_batch: int | None = None,
    mnist_samples: int | None = None,
    gpt_config: str | None = None,
    weights: str | None = None,
) -> tuple[nn.Module, Any, Callable | None, str]:
    """``(fp32 model, timing batch, metric(forward), metric name)`` for a CLI workload.

    mnist1d-cnn: the standard MNIST-1D set (4000 train / 1000 test), or ``mnist_samples``
    generated samples split 80/20; the metric is test accuracy (0..1). char-gpt: the
    quick-corpus GPT, ``gpt_config`` ``"LxE"`` (layers x width, context 256) or the bench's
    4x384; the metric is validation perplexity. minilm: :func:`load_minilm` (``weights``: a local
    directory of the pretrained model, else random weights from ``seed``); the metric is the
    worst sentence's embedding cosine similarity to fp32. ``train_steps`` > 0 trains the model
    with mixprec O2 bf16 first (batch ``train_batch``, default the workload's).
    """
    torch.manual_seed(seed)
    if name == "minilm":
        model, encode = load_minilm(weights, seed)
        inputs = encode(SENTENCES[:batch])
        return model, inputs, _min_cosine_metric(model, inputs), "min cos"
    from mixprec.bench.workloads import WORKLOADS as TRAIN
    from mixprec.bench.workloads import make_large_mnist1d

    wl = TRAIN[name]
    if name == "mnist1d-cnn" and mnist_samples:
        data = make_large_mnist1d(mnist_samples)
    else:
        data = wl.prepare(name == "char-gpt", seed)  # full MNIST-1D; the quick corpus
    if name == "char-gpt" and gpt_config:
        from mixprec.bench.models import GPT, GPTConfig

        try:
            layers, width = (int(v) for v in gpt_config.lower().split("x"))
        except ValueError:
            raise SystemExit(
                f"--gpt-config takes LAYERSxWIDTH such as 2x192, received {gpt_config!r}."
            ) from None
        model = GPT(GPTConfig(n_layer=layers, n_embd=width, n_head=max(1, width // 32)))
    else:
        model = wl.make_model(data)
    if train_steps:
        import mixprec

        model, opt = mixprec.initialize(
            model, wl.make_optimizer(model.parameters()), "O2", torch.bfloat16
        )
        stream = wl.batches(data, train_batch or wl.batch_size, seed)
        for _, (x, y) in zip(range(train_steps), stream):
            opt.backward(wl.loss(model(x), y))
            opt.step()
            opt.zero_grad()
        model = for_inference(model, torch.float32, optimizer=opt)
    x, _ = wl.example_batch(data, batch)
    if wl.metric == "accuracy":
        return model, x, lambda fwd: wl.evaluate(fwd, data), "accuracy"
    return model, x, lambda fwd: math.exp(wl.evaluate(fwd, data)), "perplexity"
