"""Every warning mixprec emits is a class of :mod:`mixprec.warnings`, so one public import
filters them: the base :class:`~mixprec.warnings.MixprecWarning`, or one kind of it."""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest
import torch

import mixprec
from mixprec.warnings import MixprecNumericsWarning, MixprecPerformanceWarning, MixprecWarning

PKG = pathlib.Path(mixprec.__file__).resolve().parent
CLASSES = {"MixprecWarning", "MixprecNumericsWarning", "MixprecPerformanceWarning"}


def _warn_calls() -> list[tuple[str, int, str | None]]:
    """(file, line, category as written) of each ``warnings.warn`` in the package but
    :mod:`mixprec.amp`, which warns with torch's classes as ``torch.amp`` does."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if path.relative_to(PKG).parts[0] == "amp":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "warnings.warn":
                given = [*node.args[1:2], *(k.value for k in node.keywords if k.arg == "category")]
                category = ast.unparse(given[0]) if given else None
                found.append((str(path.relative_to(PKG)), node.lineno, category))
    return found


def test_every_warning_mixprec_emits_is_a_public_mixprec_class():
    calls = _warn_calls()
    assert len(calls) >= 15, calls  # the scan found the package's warnings
    assert [c for c in calls if c[2] not in CLASSES] == []


def test_the_classes_filter_as_their_builtin_kinds_too():
    assert issubclass(MixprecNumericsWarning, RuntimeWarning)
    assert issubclass(MixprecPerformanceWarning, MixprecWarning)
    assert all(issubclass(c, UserWarning) for c in (MixprecWarning, MixprecNumericsWarning))
    assert mixprec.warnings.MixprecWarning is MixprecWarning  # reachable after `import mixprec`


def test_one_filter_on_the_base_class_turns_a_numerics_warning_into_an_error():
    """O3 fp16 with RMSprop's eps=1e-8 under the optimizer's own 16-bit step: eps rounds to 0."""
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MixprecWarning)
        warnings.simplefilter("ignore", MixprecPerformanceWarning)  # fp16 here: filtered first
        with pytest.raises(MixprecNumericsWarning, match="rounds to 0"):
            mixprec.initialize(model, opt, mixprec.Recipe("O3", torch.float16, update=None))
