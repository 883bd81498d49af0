"""Fixtures shared by the test files."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """One torch thread for the test: emulated FP8 GEMMs are many small calls, which
    oversubscribe a shared CPU (8x slower with two threads), and numbers compared are all made
    alike. The thread count is given back afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
