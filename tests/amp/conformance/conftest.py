"""The conformance suite runs every test twice: against ``torch.amp`` (the control: proof that
the test states torch's own behaviour) and against ``mixprec.amp`` (the drop-in must match it).

Its tests are written for mixprec from torch.amp's documented behaviour; they check the same
behaviours as PyTorch's GradScaler and CPU autocast tests, on the CPU. Where mixprec.amp fixes
one of torch's traps, the test is in tests/amp/test_amp.py instead, marked there as failing on
torch.amp."""

from __future__ import annotations

import pytest
import torch

import mixprec.amp


@pytest.fixture(params=[torch.amp, mixprec.amp], ids=["torch.amp", "mixprec.amp"])
def A(request):
    """The namespace under test: ``A.autocast``, ``A.GradScaler``, ``A.custom_fwd``, ..."""
    return request.param
