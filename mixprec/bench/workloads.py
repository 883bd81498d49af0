"""The benchmark workloads of ``mixprec bench``: data, model, optimizer, loss and metric.

Each :class:`BenchWorkload` is plain data plus small module-level functions (picklable, no
lambdas), so a runner can train any of them the same way in fp32 and in mixed precision and
measure the wall-clock time until the held-out metric crosses the workload's fixed ``target``.

Design choices:

* Datasets are fixed: the ``seed`` given to ``prepare`` / ``batches`` changes only the batch
  order (and, through the caller's ``torch.manual_seed``, the initialisation), never the data,
  so every seed and every precision is measured on the same held-out split.
* Models return logits in whatever dtype they run in; :func:`cross_entropy` upcasts them to
  float32, so the loss (and its reduction) is always computed in fp32.
* ``quick`` data is small (a 1000/250 MNIST-1D set, a 400k-character corpus) for smoke runs and
  tests; targets are calibrated on the full data only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.bench.corpus import CharCorpus, build_corpus
from mixprec.bench.models import GPT, GPTConfig, SeedMLP

__all__ = [
    "MNIST1DCNN",
    "WORKLOADS",
    "BenchWorkload",
    "cross_entropy",
    "load_mnist1d",
    "make_large_mnist1d",
]

QUICK_CORPUS_CHARS = 400_000
_MNIST_EVAL_CHUNK = 1000
_GPT_EVAL_WINDOWS = 32
_GPT_EVAL_BATCH = 16
_BLOCK = GPTConfig().block_size


@dataclass(frozen=True)
class BenchWorkload:
    """One time-to-target benchmark; see the module docstring for the conventions."""

    name: str
    description: str
    metric: str  # "accuracy" (higher is better) or "val_loss" (lower is better)
    higher_is_better: bool
    target: float
    batch_size: int
    steps: int
    quick_steps: int
    eval_every: int
    prepare: Callable[[bool, int], Any]
    make_model: Callable[[Any], nn.Module]
    make_optimizer: Callable[[Iterable], torch.optim.Optimizer]
    batches: Callable[[Any, int, int], Iterator[tuple[Tensor, Tensor]]]
    loss: Callable[[Tensor, Tensor], Tensor]
    evaluate: Callable[[Callable[[Tensor], Tensor], Any], float]
    samples_per_batch: Callable[[int], int]
    example_batch: Callable[[Any, int], tuple[Tensor, Tensor]]

    def reached(self, value: float) -> bool:
        """Whether a metric ``value`` meets this workload's target."""
        return value >= self.target if self.higher_is_better else value <= self.target


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy in float32; works for (N, C) and (B, T, C) logits."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --------------------------------------------------------------------------- MNIST-1D


class MNIST1DCNN(nn.Module):
    """The CNN of the MNIST-1D paper (Greydanus, 2020): three strided convs and a linear head.

    Input ``(batch, 40)``; lengths 40 -> 19 -> 10 -> 5, so the head sees 25 * 5 = 125 features.
    5,210 parameters.
    """

    def __init__(self, channels: int = 25, length: int = 40, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        for kernel in (5, 3, 3):  # stride 2, padding 1
            length = (length + 2 - kernel) // 2 + 1
        self.linear = nn.Linear(channels * length, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = x.view(x.shape[0], 1, x.shape[-1])
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        return self.linear(x.flatten(1))


def load_mnist1d(seed: int = 42, num_samples: int | None = None) -> dict[str, Tensor]:
    """MNIST-1D generated locally: ``x, y, x_test, y_test``. The default is the standard
    dataset (4000 train / 1000 test); ``num_samples`` splits 80/20 the same way."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "MNIST-1D needs the 'mnist1d' package: pip install 'mixprec[bench]'."
        ) from exc
    args = get_dataset_args()
    args.seed = seed
    if num_samples is not None:
        args.num_samples = num_samples
    data = make_dataset(args)
    return {
        k: torch.as_tensor(data[k], dtype=torch.float32 if k.startswith("x") else torch.long)
        for k in ("x", "y", "x_test", "y_test")
    }


@functools.lru_cache(maxsize=2)
def _mnist1d(quick: bool) -> dict[str, Tensor]:
    if quick:  # 1000 train / 250 test: generated in ~1 s instead of ~4 s
        return load_mnist1d(num_samples=1250)
    return load_mnist1d()  # the standard dataset: 4000 train / 1000 test, seed 42


def prepare_mnist1d(quick: bool, seed: int) -> dict[str, Tensor]:
    """MNIST-1D tensors ``x, y, x_test, y_test`` (cached). ``seed`` does not change the data."""
    return _mnist1d(bool(quick))


@functools.lru_cache(maxsize=1)
def make_large_mnist1d(num_samples: int = 50_000, seed: int = 42) -> dict[str, Tensor]:
    """A larger MNIST-1D set (80/20 split) for timing; slow to generate (~3.5 s per 5000)."""
    return load_mnist1d(seed, num_samples)


def mnist1d_batches(
    data: dict[str, Tensor], batch_size: int, seed: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless training batches: a stream of seeded permutations, cut into equal batches."""
    x, y = data["x"], data["y"]
    g = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    while True:
        while len(order) < batch_size:
            order = torch.cat([order, torch.randperm(len(x), generator=g)])
        idx, order = order[:batch_size], order[batch_size:]
        yield x[idx], y[idx]


def mnist1d_example_batch(data: dict[str, Tensor], batch_size: int) -> tuple[Tensor, Tensor]:
    """The first ``batch_size`` training samples (wrapping around if there are fewer)."""
    idx = torch.arange(batch_size) % len(data["x"])
    return data["x"][idx], data["y"][idx]


@torch.no_grad()
def mnist1d_accuracy(forward: Callable[[Tensor], Tensor], data: dict[str, Tensor]) -> float:
    """Test accuracy (0..1), evaluated in chunks of 1000 samples."""
    x, y = data["x_test"], data["y_test"]
    correct = 0
    for start in range(0, len(x), _MNIST_EVAL_CHUNK):
        pred = forward(x[start : start + _MNIST_EVAL_CHUNK]).argmax(-1)
        correct += int((pred == y[start : start + _MNIST_EVAL_CHUNK]).sum())
    return correct / len(x)


def make_seed_mlp(data: dict[str, Tensor]) -> nn.Module:
    """A fresh fp32 :class:`SeedMLP` (40 -> 4096 -> 4096 -> 10)."""
    return SeedMLP(data["x"].shape[1], 4096, 10)


def make_cnn(data: dict[str, Tensor]) -> nn.Module:
    """A fresh fp32 :class:`MNIST1DCNN`."""
    return MNIST1DCNN(length=data["x"].shape[1])


def adamw_seed_mlp(params: Iterable) -> torch.optim.Optimizer:
    """AdamW, lr 1e-3 (the demo's optimizer)."""
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def adam_cnn(params: Iterable) -> torch.optim.Optimizer:
    """Adam, lr 1e-2 (the MNIST-1D paper's setting)."""
    return torch.optim.Adam(params, lr=1e-2)


# --------------------------------------------------------------------------- char-GPT


def prepare_corpus(quick: bool, seed: int) -> CharCorpus:
    """The stdlib character corpus (cached); ``seed`` does not change the data."""
    return build_corpus(QUICK_CORPUS_CHARS if quick else None)


def _spaced(high: int, count: int) -> Tensor:
    """``count`` evenly spaced integer offsets from 0 to ``high`` (integer arithmetic)."""
    return torch.arange(count) * high // max(count - 1, 1)


def _windows(ids: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
    w = ids[starts[:, None] + torch.arange(_BLOCK + 1)]
    return w[:, :-1], w[:, 1:]


def corpus_batches(data: CharCorpus, batch_size: int, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless batches of random 257-character train windows: x = first 256, y = next chars."""
    g = torch.Generator().manual_seed(seed)
    high = len(data.train) - _BLOCK
    while True:
        yield _windows(data.train, torch.randint(high, (batch_size,), generator=g))


def corpus_example_batch(data: CharCorpus, batch_size: int) -> tuple[Tensor, Tensor]:
    """``batch_size`` train windows at evenly spaced offsets."""
    starts = _spaced(len(data.train) - _BLOCK - 1, batch_size)
    return _windows(data.train, starts)


@torch.no_grad()
def corpus_val_loss(forward: Callable[[Tensor], Tensor], data: CharCorpus) -> float:
    """Mean next-character cross-entropy over 32 fixed, evenly spaced validation windows."""
    if len(data.val) < _BLOCK + 1:
        raise ValueError(f"validation split has {len(data.val)} chars; need {_BLOCK + 1}")
    starts = _spaced(len(data.val) - _BLOCK - 1, _GPT_EVAL_WINDOWS)
    total, count = 0.0, 0
    for chunk in starts.split(_GPT_EVAL_BATCH):
        x, y = _windows(data.val, chunk)
        total += float(cross_entropy(forward(x), y)) * y.numel()
        count += y.numel()
    return total / count


def make_gpt(data: CharCorpus) -> nn.Module:
    """A fresh fp32 :class:`GPT` with the default :class:`GPTConfig` (vocab 96)."""
    return GPT(GPTConfig())


def make_small_gpt(data: CharCorpus) -> nn.Module:
    """A fresh fp32 :class:`GPT` of 2 layers, width 128 (0.4 M parameters): long runs on a CPU."""
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128))


def adamw_gpt(params: Iterable) -> torch.optim.Optimizer:
    """AdamW as in nanoGPT: weight decay 0.1 on matrices/embeddings, none on biases and norms."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=1e-3, betas=(0.9, 0.95), fused=True
    )


def _identity(batch_size: int) -> int:
    return batch_size


def _tokens(batch_size: int) -> int:
    return batch_size * _BLOCK  # tokens per step


# --------------------------------------------------------------------------- registry

_MNIST: dict[str, Any] = {
    "prepare": prepare_mnist1d,
    "batches": mnist1d_batches,
    "loss": cross_entropy,
    "evaluate": mnist1d_accuracy,
    "samples_per_batch": _identity,
    "example_batch": mnist1d_example_batch,
    "metric": "accuracy",
    "higher_is_better": True,
}
#: what the character GPTs share: the corpus, its batches, the loss and the validation loss
_CORPUS: dict[str, Any] = {
    "metric": "val_loss",
    "higher_is_better": False,
    "batch_size": 16,
    "prepare": prepare_corpus,
    "make_optimizer": adamw_gpt,
    "batches": corpus_batches,
    "loss": cross_entropy,
    "evaluate": corpus_val_loss,
    "samples_per_batch": _tokens,
    "example_batch": corpus_example_batch,
}

WORKLOADS: dict[str, BenchWorkload] = {
    w.name: w
    for w in (
        BenchWorkload(
            name="seed-mlp",
            description="Keras-guide MLP (40-4096-4096-10) on MNIST-1D, AdamW 1e-3, batch 512",
            # Target: fp32 test accuracy, measured every 10 steps on the standard set (seeds 0/1):
            # 0.52/0.50 @50, 0.55/0.55 @60, 0.62/0.60 @100, 0.66/0.65 @150. 0.60 is first reached at
            # step 100 / 90, i.e. ~2/3 of the 150 steps (0.55 would already be hit at 40%).
            target=0.60,
            batch_size=512,
            steps=150,
            quick_steps=20,
            eval_every=10,
            make_model=make_seed_mlp,
            make_optimizer=adamw_seed_mlp,
            **_MNIST,
        ),
        BenchWorkload(
            name="mnist1d-cnn",
            description="MNIST-1D paper CNN (3 conv + linear, 5.2k params), Adam 1e-2, batch 100",
            # Target: fp32 (seeds 0/1/2, eval every 250 steps) first reaches 0.90 at step
            # 1000 / 1500 / 750 and plateaus at 0.925 / 0.923 / 0.939 (the paper reports ~94%).
            target=0.90,
            batch_size=100,
            steps=8000,
            quick_steps=300,
            eval_every=100,
            make_model=make_cnn,
            make_optimizer=adam_cnn,
            **_MNIST,
        ),
        BenchWorkload(
            name="char-gpt",
            description="nanoGPT-style GPT (4x384, ctx 256) on a stdlib-source character corpus",
            # Target: one fp32 run (seed 0, full corpus) had val loss 3.62 @5, 3.08 @60, 2.95 @120,
            # 2.77 @180, 2.68 @240 steps; 2.70 is crossed at ~step 230, ~60% of the 400 steps.
            target=2.70,
            steps=400,
            quick_steps=8,
            eval_every=20,
            make_model=make_gpt,
            **_CORPUS,
        ),
        BenchWorkload(
            name="char-gpt-small",
            description="nanoGPT-style GPT (2x128, ctx 256) on the same corpus, for long runs",
            # Target: char-gpt's 2.70, which this narrower model reaches later
            target=2.70,
            steps=2000,
            quick_steps=8,
            eval_every=100,
            make_model=make_small_gpt,
            **_CORPUS,
        ),
    )
}
