"""Optional test dependencies, by the extra that installs them.

``pip install -e ".[test]"`` is the light core (the suite and the demo); the integration stacks
are their own extras, so a test that needs one skips with the install line that brings it:
``need("transformers")`` -> skipped, ``needs transformers: pip install -e ".[test,integrations]"``.
CI installs every extra, so there nothing skips for a missing package.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import pytest

EXTRA = {
    "transformers": "integrations",
    "accelerate": "integrations",
    "lightning": "integrations",
    "pytorch_lightning": "integrations",
    "trl": "integrations",
    "datasets": "integrations",  # trl's
    "tokenizers": "integrations",  # transformers'
    "onnx": "inference",
    "onnxruntime": "inference",
    "onnxscript": "inference",
}


def install_hint(module: str) -> str:
    """The skip reason for a missing ``module``: which extra installs it."""
    return f'needs {module}: pip install -e ".[test,{EXTRA[module]}]"'


def need(module: str) -> ModuleType:
    """``module`` imported, or the test skipped with the extra that installs it."""
    return pytest.importorskip(module, reason=install_hint(module))


def has(*modules: str) -> bool:
    """Whether any of ``modules`` is importable (for ``skipif`` on a whole test)."""
    return any(importlib.util.find_spec(m) is not None for m in modules)
