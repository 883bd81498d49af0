"""Record the trajectory reference that named recipes must reproduce bit for bit.

    python tools/record_recipe_reference.py                       # this CPU's capability
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python tools/record_recipe_reference.py

A small GPT trains 5 AdamW steps (fixed data and init) under each case of
``tests/recipe_cases.py``; its losses, ``model.state_dict()`` and ``fp32_state_dict`` go to
``tests/data/recipe_reference_<capability>.pt``. The kernels differ between CPU capabilities
(AVX2 emulates bf16), so each capability has its own file; the test compares against the file
of the capability it runs on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from recipe_cases import CASES, capability_key, train  # noqa: E402


def main() -> None:
    out: dict[str, object] = {"capability": capability_key(), "torch": str(torch.__version__)}
    for name in CASES:
        out[name] = train(name)
        print(f"{name:28s} final loss {out[name]['losses'][-1]:.6f}")
    path = ROOT / "tests" / "data" / f"recipe_reference_{capability_key()}.pt"
    path.parent.mkdir(exist_ok=True)
    torch.save(out, path)
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
