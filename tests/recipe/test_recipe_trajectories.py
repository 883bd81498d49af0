"""Named recipes reproduce the trajectories recorded before the Recipe existed, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from recipe_cases import CASES, capability_key, train

REFERENCE = Path(__file__).resolve().parents[1] / "data" / f"recipe_reference_{capability_key()}.pt"


@pytest.fixture(scope="module")
def reference() -> dict:
    if not REFERENCE.is_file():
        pytest.skip(
            f"no trajectory reference for this CPU's kernels ({capability_key()}); recorded: "
            f"{sorted(p.stem for p in REFERENCE.parent.glob('recipe_reference_*.pt'))}"
        )
    return torch.load(REFERENCE, weights_only=True)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", list(CASES))
def test_named_recipe_reproduces_recorded_trajectory(name: str, reference: dict) -> None:
    want, got = reference[name], train(name)
    assert got["losses"] == want["losses"]
    for part in ("model", "fp32"):
        assert list(got[part]) == list(want[part])
        for key, value in want[part].items():
            assert got[part][key].dtype == value.dtype, (part, key)
            assert torch.equal(got[part][key], value), (part, key)
