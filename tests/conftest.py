"""Fixtures shared by the test files."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# torch's inductor caches compiled CPU kernels on disk without keying them on
# ATEN_CPU_CAPABILITY: a kernel built for one vector width and loaded under another computes
# garbage or crashes the process (torch 2.13). A run that caps the capability, to check the
# suite as an older CPU would run it, gets a cache of its own (subprocesses inherit it).
_CAPABILITY = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
if _CAPABILITY and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_mixprec_{_CAPABILITY}"
    )


@pytest.fixture
def one_thread():
    """One torch thread for the test: emulated FP8 GEMMs are many small calls, which
    oversubscribe a shared CPU (8x slower with two threads), and numbers compared are all made
    alike. The thread count is given back afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def decompose_small_attention(monkeypatch):
    """mixprec's decomposed attention at any size: ``kernels="auto"`` picks it only from a
    measured size up (``attention.MIN_DECOMPOSED_WORK``), and the tests of its semantics use tiny
    tensors."""
    from mixprec._core import attention

    monkeypatch.setattr(attention, "MIN_DECOMPOSED_WORK", 0)
