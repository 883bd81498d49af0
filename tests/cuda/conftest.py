"""The CUDA tier: ``python -m pytest -q -m cuda``. Every test here carries the ``cuda`` marker
and is skipped on machines without a CUDA GPU (CI), so the CPU suite collects it harmlessly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the CPU suite's helpers

_SKIP = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.cuda)
            item.add_marker(_SKIP)
