"""``mixprec demo``: train the Keras guide's model on MNIST-1D in fp32 and in mixed precision.

The model is the Keras mixed-precision guide's MLP (input -> 4096 -> 4096 -> 10, float32
softmax cross-entropy), with the input width adapted to MNIST-1D's 40 features. The data is
generated locally by the ``mnist1d`` package (nothing is downloaded). Each mode trains the same
model from the same seed on the same batches; the table compares median step time, test
accuracy, peak memory and skipped steps side by side.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import mixprec
from mixprec.memory import PeakMemory
from mixprec.models import SeedMLP
from mixprec.progress import make_progress

__all__ = ["DemoResult", "load_mnist1d", "run_demo"]


def load_mnist1d(seed: int = 42) -> dict[str, torch.Tensor]:
    """The standard MNIST-1D dataset (4000 train / 1000 test), generated locally."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("The demo needs the 'mnist1d' package: pip install 'mixprec[bench]'."
                           ) from exc
    args = get_dataset_args()
    args.seed = seed
    data = make_dataset(args)
    return {"x": torch.as_tensor(data["x"], dtype=torch.float32),
            "y": torch.as_tensor(data["y"], dtype=torch.long),
            "x_test": torch.as_tensor(data["x_test"], dtype=torch.float32),
            "y_test": torch.as_tensor(data["y_test"], dtype=torch.long)}


@dataclass
class DemoResult:
    mode: str
    median_step: float
    accuracy: float
    first_loss: float
    final_loss: float
    peak_bytes: int | None
    skipped_steps: int


def _batches(n: int, batch: int, steps: int, seed: int) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    done = 0
    while done < steps:
        for idx in torch.randperm(n, generator=g).split(batch):
            if len(idx) == batch and done < steps:
                done += 1
                yield idx


def train_one(data: dict[str, torch.Tensor], level: str, dtype: torch.dtype | None, steps: int,
              batch: int = 512, lr: float = 1e-3, seed: int = 0,
              on_step: Callable[[], None] | None = None) -> DemoResult:
    """Train the seed MLP at ``level`` for ``steps`` steps and evaluate on the test split."""
    x, y = data["x"], data["y"]
    times: list[float] = []
    losses: list[float] = []
    with PeakMemory() as mem:
        torch.manual_seed(seed)
        model = SeedMLP(x.shape[1], 4096, 10)
        opt: Any = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
        model, opt = mixprec.initialize(model, opt, level=level, dtype=dtype)
        for idx in _batches(len(x), batch, steps, seed):
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            times.append(time.perf_counter() - t0)
            if on_step is not None:
                on_step()
    model.eval()
    with torch.no_grad():
        pred = model(data["x_test"]).argmax(-1)
    accuracy = (pred == data["y_test"]).float().mean().item()
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    name = "fp32" if level == "O0" else f"{level} {short.get(dtype, str(dtype))}"
    return DemoResult(name, statistics.median(times[2:] or times), accuracy, losses[0], losses[-1],
                      mem.peak_bytes, opt.skipped_steps)


def run_demo(steps: int = 60, levels: tuple[str, ...] | None = None, batch: int = 512,
             seed: int = 0, progress: bool = True) -> list[DemoResult]:
    """Train in fp32 and the best mixed levels for this machine; return one result per mode."""
    dtype = mixprec.default_dtype("cpu")
    levels = levels or ("O0", "O1", "O2")
    data = load_mnist1d()
    results = []
    bar = make_progress(progress)
    with bar as ui:
        for level in levels:
            task = ui.add(f"{'fp32' if level == 'O0' else level}", steps)
            results.append(train_one(data, level, None if level == "O0" else dtype, steps, batch,
                                     seed=seed, on_step=lambda t=task: ui.advance(t)))
    return results


def format_results(results: list[DemoResult]) -> list[list[str]]:
    """Rows for the demo table; speed-up is relative to the first (fp32) result."""
    base = results[0].median_step
    rows = []
    for r in results:
        mem = "-" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.0f} MB"
        rows.append([r.mode, f"{r.median_step * 1e3:.0f} ms", f"{base / r.median_step:.2f}x",
                     f"{r.accuracy * 100:.1f}%", f"{r.final_loss:.3f}", mem, str(r.skipped_steps)])
    return rows


HEADERS = ["mode", "step", "speed-up", "test acc", "final loss", "peak mem", "skipped"]
