"""Old flat module paths (``mixprec.policy``, ``mixprec.locate`` ...) that still work, with a
DeprecationWarning, after the modules moved into subpackages.

Design: each old path is a small proxy module registered in ``sys.modules`` when mixprec is
imported. It imports nothing until used; the first attribute read warns once per name and
forwards to the module's new home, so ``from mixprec.policy import Policy``, attribute access
and unpickling objects saved under the old paths keep working, while the warning names the new
path. Attribute writes are forwarded too, so patching through an old path still reaches the
code that runs. Proxies rather than a copy of each module: there is one module object per
concept, so its state (global policy, registries) is never duplicated.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from typing import Any

#: old module (relative to ``mixprec``) -> its new home
MOVED: dict[str, str] = {
    **{
        m: f"mixprec.core.{m}"
        for m in (
            "policy",
            "cast_table",
            "torch_lists",
            "dispatch",
            "engine",
            "kernels",
            "norms",
            "loss_scale",
            "optimizer",
            "clipping",
            "initialize",
            "lean",
            "hardware",
            "memory",
            "footprint",
        )
    },
    "keras": "mixprec.compat.keras",
    **{
        m: f"mixprec.numerics.{m}"
        for m in ("locate", "opstats", "range_audit", "range_plot", "tuning", "alignment")
    },
    "report_cli": "mixprec.numerics.report",
    "export": "mixprec.inference.export",
    "quantize": "mixprec.inference.quantize",
    "infer_bench": "mixprec.inference.bench",
    "models": "mixprec.bench.models",
    "benchmarking": "mixprec.bench.steps",
    "demo": "mixprec.cli.demo",
    "progress": "mixprec.cli.progress",
}


class _MovedModule(types.ModuleType):
    """Stands in for ``mixprec.<old>``; every use reaches the module's new home."""

    def __init__(self, old: str, new: str):
        super().__init__(old, f"Deprecated alias of :mod:`{new}`.")
        self.__dict__["_new"] = new
        self.__dict__["_warned"] = False

    def _target(self) -> types.ModuleType:
        if not self.__dict__["_warned"]:
            self.__dict__["_warned"] = True
            warnings.warn(
                f"{self.__name__} is deprecated and will be removed: import from "
                f"{self._new} instead (public names also import from mixprec).",
                DeprecationWarning,
                stacklevel=3,
            )
        return importlib.import_module(self._new)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):  # introspection (inspect, pickle
            raise AttributeError(name)  # scans of sys.modules) must not warn or import
        return getattr(self._target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target(), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._target(), name)

    def __dir__(self) -> list[str]:
        return dir(importlib.import_module(self._new))


def install(package: types.ModuleType) -> None:
    """Register the old paths; attach each to ``package`` unless a public name holds it."""
    for old, new in MOVED.items():
        full = f"{package.__name__}.{old}"
        proxy = sys.modules.setdefault(full, _MovedModule(full, new))
        if old not in package.__dict__:  # ``mixprec.initialize`` stays the function
            package.__dict__[old] = proxy
