"""mixprec on ``torch.distributed``: DDP and FSDP2, 16-bit gradient communication,
rank-consistent overflow skips and distributed checkpoints.

One concept per module:

* :mod:`~mixprec.distributed.verdicts` -- every rank skips the same steps (one MAX all-reduce of
  the verdict flags per step) and every loss scaler stays identical;
* :mod:`~mixprec.distributed.ddp` -- ``initialize`` then DDP (the wrong order is refused) and a
  bf16/fp16 all-reduce communication hook;
* :mod:`~mixprec.distributed.fsdp` -- mixprec levels as FSDP2 ``MixedPrecisionPolicy``, FSDP's
  fp32 shards as the master weights;
* :mod:`~mixprec.distributed.fp8_gather` -- FSDP2 all-gathers tensorwise FP8 weights in FP8;
* :mod:`~mixprec.distributed.checkpoint` -- save/resume under both, loss scalers
  included, and a plain fp32 state dict from a checkpoint offline.

Usage (``torchrun --nproc_per_node=2 train.py``; see ``docs/distributed.md``)::

    dist.init_process_group("gloo")                       # "nccl" on GPUs
    model, opt = mixprec.initialize(model, opt, "O2", torch.bfloat16)
    model = mixprec.distributed.wrap_ddp(model, opt)      # bf16 all-reduce, synced skips
"""

from typing import Any

from mixprec.distributed.checkpoint import (
    fp32_full_state_dict,
    fp32_state_dict_from_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from mixprec.distributed.ddp import AllReduceHook, wrap_ddp
from mixprec.distributed.verdicts import FlagReducer, assert_in_sync, sync_verdicts

_LAZY = {"fsdp_mp_policy", "initialize_fsdp"}


def __getattr__(name: str) -> Any:
    """The FSDP2 names, imported on first use: ``torch.distributed.fsdp`` took ~0.7 s of
    ``import mixprec`` (which imports this package for its plain-DDP hooks)."""
    if name in _LAZY:
        from mixprec.distributed import fsdp

        return getattr(fsdp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AllReduceHook",
    "FlagReducer",
    "assert_in_sync",
    "fp32_full_state_dict",
    "fp32_state_dict_from_checkpoint",
    "fsdp_mp_policy",
    "initialize_fsdp",
    "load_checkpoint",
    "save_checkpoint",
    "sync_verdicts",
    "wrap_ddp",
]
