"""The training cases whose trajectories named recipes reproduce bit for bit.

Each case prepares a small GPT and AdamW; :func:`train` runs 5 steps on fixed data and returns
the losses, ``model.state_dict()`` and :func:`mixprec.fp32_state_dict`. The reference files
under ``tests/data`` were recorded by ``tools/record_recipe_reference.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import mixprec
from mixprec._core.hardware import _read_cpu
from mixprec.bench.models import GPT, GPTConfig

BF16, FP16 = torch.bfloat16, torch.float16
STEPS = 5
#: the torch thread count every case trains at, whatever the machine or OMP_NUM_THREADS: a
#: matmul's reduction order depends on it, so the recorded bits do too
THREADS = 2
CONFIG = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=16)

Setup = Callable[[torch.nn.Module, torch.optim.Optimizer], tuple[Any, Any]]


def _init(recipe: Any, dtype: Any = None) -> Setup:
    return lambda model, opt: mixprec.initialize(model, opt, recipe, dtype)


R = mixprec.Recipe
_ALL = mixprec.FP8Config
#: each case as a named recipe, or a named recipe with one property changed
CASES: dict[str, Setup] = {
    "O0": _init("O0"),
    "O1-bf16": _init("O1", BF16),
    "O1-fp16": _init("O1", FP16),
    "O2-bf16": _init("O2", BF16),
    "O2-fp16": _init("O2", FP16),
    "O3-bf16": _init("O3", BF16),
    "O3-fp16": _init("O3", FP16),
    "bf16-mixed": _init("bf16-mixed"),
    "16-mixed": _init("16-mixed"),
    "bf16-true": _init("bf16-true"),
    "O3-bf16-stochastic": _init(R("O3", BF16, update="stochastic", update_seed=3)),
    "O3-bf16-nearest-bf16-states": _init(
        R("O3", BF16).replace(update="nearest", optimizer_states=BF16)
    ),
    "O2-bf16-norms-16bit": _init(R("O2", BF16, keep_fp32="none")),
    "O2-bf16-outputs-as-computed": _init(R("O2", BF16, outputs=None)),
    "O2-fp16-static-scale": _init("O2 fp16 loss_scale=128.0"),
    "O2-fp16-scaler-settings": _init(
        R("O2", FP16, loss_scale=mixprec.LossScaling(init_scale=2.0**20, growth_interval=2))
    ),
    "O2-bf16-fp8-tensorwise": _init(R("O2", BF16, fp8=_ALL("tensorwise", layers="all"))),
    "O2-bf16-fp8-rowwise": _init(R("fp8-rowwise", BF16, fp8=_ALL("rowwise", layers="all"))),
    "O2-bf16-activations-fp8": _init(
        R("O2", BF16, activations=mixprec.ActivationConfig("fp8", min_numel=1))
    ),
    "O1-bf16-activations-16bit": _init(
        R("O1", BF16, activations=mixprec.ActivationConfig("16-bit", min_numel=1))
    ),
}


def capability_key() -> str:
    """Which kernels this CPU runs: torch's vector width and the 16-bit units oneDNN may use."""
    _, flags = _read_cpu()
    units = sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16", "avx512_fp16"))
    return "-".join([str(torch.backends.cpu.get_cpu_capability()).lower(), *units])


def train(name: str) -> dict[str, Any]:
    """5 AdamW steps of the small GPT under case ``name``, from fixed weights and data, at
    :data:`THREADS` torch threads (the caller's count is given back)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return _train(name)
    finally:
        torch.set_num_threads(threads)


def _train(name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = CASES[name](model, opt)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        idx = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size + 1), generator=gen)
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, CONFIG.vocab_size), idx[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "fp32": mixprec.fp32_state_dict(model, opt),
    }
