"""``import mixprec`` changes nothing in torch; mixprec registers what it needs when it is first
used, and plain torch code behaves bit for bit as without it even then.

Each check runs in a fresh interpreter (this file run as a script, with the worktree's package
first on the path): the test process has long imported and used mixprec. The snapshot holds
torch's functions and classes by identity, the contents of the module-level registries of the
torch modules mixprec touches (global optimizer and module hooks, ``torch.library``'s
registrations, fx's side-effect set), ``sys.meta_path``, the dispatcher's registrations on the
autocast keys, dynamo's callbacks and allow-list where dynamo is loaded, and torch's global
modes.
"""

from __future__ import annotations

import contextlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

MODULES = (
    "torch",
    "torch.nn",
    "torch.nn.functional",
    "torch.nn.init",
    "torch.nn.utils",
    "torch.nn.utils.clip_grad",
    "torch.nn.modules.module",
    "torch.optim",
    "torch.optim.optimizer",
    "torch.autograd",
    "torch.autograd.graph",
    "torch.amp",
    "torch.amp.autocast_mode",
    "torch.utils.checkpoint",
    "torch.library",
    "torch.fx.node",
    "torch.overrides",
    "torch.compiler",
)
# the subpackages whose import is checked besides every module (see test_importing_...)
SUBPACKAGES = (
    "mixprec",
    "mixprec.amp",
    "mixprec.compat",
    "mixprec.distributed",
    "mixprec.graph",
    "mixprec.inference",
    "mixprec.numerics",
)
KEYS = ("AutocastCPU", "AutocastCUDA", "CompositeImplicitAutograd", "CompositeExplicitAutograd")


# -- the snapshot (run in the child process) ---------------------------------------------------


def _classes() -> list[type]:
    optimizers = [
        c
        for c in vars(torch.optim).values()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
    ]
    return [
        torch.Tensor,
        torch._C.TensorBase,
        nn.Parameter,
        nn.Module,
        torch.autocast,
        torch.amp.GradScaler,
        torch.autograd.Function,
        *optimizers,
    ]


def _contents(value: Any) -> Any:
    """A copy of a registry's contents, compared by identity; None for anything else."""
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, (list, set, frozenset)):
        return list(value)
    return None


def _global_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "default dtype": torch.get_default_dtype(),
        "grad enabled": torch.is_grad_enabled(),
        "autocast cache": torch.is_autocast_cache_enabled(),
        "matmul precision": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
        "all ops": frozenset(torch._C._dispatch_get_all_op_names()),
        "library impls": frozenset(torch.library._impls),
    }
    for device in ("cpu", "cuda"):
        state[f"autocast {device}"] = (
            torch.is_autocast_enabled(device),
            torch.get_autocast_dtype(device),
        )
    for key in KEYS:
        state[f"kernels on {key}"] = frozenset(
            torch._C._dispatch_get_registrations_for_dispatch_key(key)
        )
    return state


def _dynamo_state() -> dict[str, Any]:
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return {}
    handler = dynamo.callback.callback_handler
    allowed = dynamo.trace_rules._allowed_callable_ids
    return {
        "dynamo start callbacks": list(handler.start_callbacks),
        "dynamo end callbacks": list(handler.end_callbacks),
        "dynamo allowed": frozenset(allowed()),
    }


def snapshot() -> dict[str, Any]:
    import importlib

    snap: dict[str, Any] = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            snap[f"{name}.{attr}"] = value
            contents = _contents(value)
            if contents is not None:
                snap[f"{name}.{attr} (contents)"] = contents
    for cls in _classes():
        for attr, value in vars(cls).items():
            snap[f"{cls.__module__}.{cls.__qualname__}.{attr}"] = value
    snap["sys.meta_path"] = list(sys.meta_path)
    snap["sys.path_hooks"] = list(sys.path_hooks)
    snap.update(_global_state())
    snap.update(_dynamo_state())
    return snap


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(x is y for x, y in zip(a, b))
    if a is b:
        return True
    return isinstance(a, (frozenset, tuple, str, int, float, bool, torch.dtype)) and a == b


def _added(old: Any, new: Any) -> str:
    if isinstance(old, frozenset) and isinstance(new, frozenset):
        added = new - old
    elif isinstance(old, (dict, list)) and isinstance(new, (dict, list)):
        added = [x for x in new if not any(x is y for y in old)]
    else:
        return ""
    return f" (added {sorted(map(repr, added))[:8]})"


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs, as readable lines. A module attribute that is new is allowed only if it
    is a submodule (importing it is not a change of torch)."""
    out = []
    for key, old in before.items():
        if key not in after:
            out.append(f"{key}: removed")
        elif not _same(old, after[key]):
            out.append(f"{key}: changed{_added(old, after[key])}")
    for key, new in after.items():
        if key not in before and not isinstance(new, type(sys)):
            out.append(f"{key}: added")
    return out


def _import(names: list[str]) -> None:
    import importlib

    for name in names:
        importlib.import_module(name)


def _every_module() -> list[str]:
    """Every module of the package but those that import, at module level, a framework of an
    extra that is not installed (read from the source: nothing is imported to find out)."""
    import mixprec

    names = [m.name for m in pkgutil.walk_packages(mixprec.__path__, "mixprec.")]
    return [n for n in names if not n.endswith("__main__") and not _missing_extras(n)]


def _missing_extras(name: str) -> list[str]:
    """The optional frameworks (``tests.extras.EXTRA``) module ``name`` imports at module level,
    when none of them is installed (``try: import lightning except: import pytorch_lightning``
    needs one of the two)."""
    import ast
    import importlib.util

    from tests.extras import EXTRA, has

    tree = ast.parse(Path(importlib.util.find_spec(name).origin).read_text())
    top = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    imported = {
        (a.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
        for stmt in top
        for node in ast.walk(stmt)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
        for a in node.names
    }
    needed = sorted(imported & set(EXTRA))
    return needed if needed and not has(*needed) else []


# -- the child's modes -------------------------------------------------------------------------


def _mixprec_modules(every: bool) -> list[str]:
    return [*SUBPACKAGES, *(_every_module() if every else [])]


def _mode_dependencies(every: bool) -> list[str]:
    """The modules other than mixprec's that importing mixprec loads, in import order."""
    known = set(sys.modules)
    _import(_mixprec_modules(every))
    return [m for m in sys.modules if m not in known and m.split(".")[0] != "mixprec"]


def _mode_import(every: bool, dependencies: str) -> list[str]:
    """Import mixprec's dependencies (torch's own submodules and third-party packages: their
    imports register ops and wrap functions of their own), take the snapshot, import mixprec."""
    for name in json.loads(Path(dependencies).read_text()):
        # a module that imports only as part of its package's import
        with contextlib.suppress(ImportError):
            _import([name])
    before = snapshot()
    _import(_mixprec_modules(every))
    return changes(before, snapshot())


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))


def _use_mixprec() -> None:
    """A region, an O2 model trained with clipping through torch's spelling."""
    import warnings

    import mixprec
    from mixprec._core.hardware import MixprecPerformanceWarning

    warnings.simplefilter("ignore", MixprecPerformanceWarning)
    with mixprec.autocast(torch.bfloat16):
        torch.softmax(torch.randn(2, 3), -1)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, opt, "O2", torch.bfloat16)
    opt.backward(model(torch.randn(4, 16)).float().sum())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()


def _plain_training() -> dict[str, torch.Tensor]:
    """Plain torch: fp32 steps with both clippings, and a torch.autocast step."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for step in range(3):
        if step == 2:
            with torch.autocast("cpu", torch.bfloat16):
                out = model(x)
        else:
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        opt.step()
        opt.zero_grad()
    return {**model.state_dict(), "norm": norm, "loss": loss.detach()}


def _mode_train(with_mixprec: bool, out: str) -> list[str]:
    if with_mixprec:
        _use_mixprec()
    torch.save(_plain_training(), out)
    return []


def _trigger(how: str) -> None:
    import warnings

    import mixprec
    from mixprec._core.hardware import MixprecPerformanceWarning

    warnings.simplefilter("ignore", MixprecPerformanceWarning)
    if how == "region":
        with mixprec.autocast(torch.bfloat16):
            pass
    elif how == "boundary":
        model = mixprec.set_policy(_net(), "bfloat16")
        model(torch.randn(2, 16))
    elif how == "optimizer":
        from mixprec._core._gradients import LossSlot
        from mixprec._core.loss_scale import LossScaler
        from mixprec._core.optimizer import MixedPrecisionOptimizer

        model = _net().to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        MixedPrecisionOptimizer(opt, [LossSlot(LossScaler())])
    elif how == "compiled region":  # the first region runs while dynamo traces it

        def f(x: torch.Tensor) -> torch.Tensor:
            with mixprec.autocast(torch.bfloat16):
                return torch.softmax(x @ x, -1)

        x = torch.randn(4, 4)
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
        want = f(x)
        assert got.dtype == want.dtype == torch.float32, (got.dtype, want.dtype)
        assert torch.equal(got, want)
    else:
        raise ValueError(how)


def _wired() -> bool:
    handler = sys.modules["torch._dynamo"].callback.callback_handler
    return any(c.__module__.startswith("mixprec") for c in handler.start_callbacks)


def _mode_enable(how: str) -> list[str]:
    """What the first use ``how`` registers: one line per registration (compared by the test)."""
    import importlib

    import mixprec

    clip = torch.nn.utils.clip_grad_norm_
    before = snapshot()
    _trigger(how)
    after = snapshot()
    found = []
    if (
        len(after["torch.optim.optimizer._global_optimizer_post_hooks (contents)"])
        == len(before["torch.optim.optimizer._global_optimizer_post_hooks (contents)"]) + 1
    ):
        found.append("optimizer post-step hook")
    if after["kernels on AutocastCPU"] > before["kernels on AutocastCPU"]:
        found.append("autocast kernels")
    if torch.nn.utils.clip_grad_norm_ is not clip:
        found.append("clipping")
    # with dynamo: its graph nodes registered; without: a hook waiting for its import (torch's
    # own optimizers load dynamo in their constructor, so which one depends on the use)
    loaded = "torch._dynamo" in sys.modules
    waiting = len(after["sys.meta_path"]) == len(before["sys.meta_path"]) + 1
    found.append("dynamo ready" if (_wired() if loaded else waiting) else "dynamo missed")
    # once is enough: a second use registers nothing more
    again = snapshot()
    _trigger(how)
    if how != "compiled region":
        found += [f"second use: {c}" for c in changes(again, snapshot())]
    importlib.import_module("torch._dynamo")
    if not _wired():
        found.append("not wired once dynamo is loaded")
    assert mixprec.__name__  # imported by the trigger
    return found


def _mode_clip() -> list[str]:
    """torch's clip_grad_norm_ on an O2 model's parameters reaches the fp32 masters; a name
    the script bound to torch's own function before is named in a warning."""
    import warnings

    import mixprec

    # as `from torch.nn.utils import clip_grad_norm_ as clip_by_name` at the script's top
    globals()["clip_by_name"] = torch.nn.utils.clip_grad_norm_
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = mixprec.initialize(model, opt, "O2", torch.bfloat16)
    found = [f"warned: {w.message}"[:40] for w in caught if "clips nothing" in str(w.message)]
    opt.backward(model(torch.randn(4, 16)).float().sum())
    masters = [m for m in opt.master_params() if m.grad is not None]
    before = torch.nn.utils.get_total_norm([m.grad for m in masters])
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    after = torch.nn.utils.get_total_norm([m.grad for m in masters])
    if torch.equal(norm, before) and torch.allclose(after, torch.tensor(1e-3), rtol=1e-3):
        found.append("clipped the masters")
    return found


def main(argv: list[str]) -> None:
    mode, *rest = argv
    if mode == "dependencies":
        result = _mode_dependencies(every=rest[0] == "every")
    elif mode == "import":
        result = _mode_import(rest[0] == "every", rest[1])
    elif mode == "clip":
        result = _mode_clip()
    elif mode == "train":
        result = _mode_train(rest[0] == "mixprec", rest[1])
    else:
        result = _mode_enable(rest[0])
    print(json.dumps(result))


# -- the tests ---------------------------------------------------------------------------------


def _child(*args: str) -> list[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    run = subprocess.run(
        [sys.executable, __file__, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_importing_mixprec_changes_nothing_in_torch(tmp_path):
    """The subpackages, dynamo not loaded: no import hook waits for it either."""
    dependencies = _child("dependencies", "subpackages")
    assert "torch._dynamo" not in dependencies
    path = tmp_path / "dependencies.json"
    path.write_text(json.dumps(dependencies))
    assert _child("import", "subpackages", str(path)) == []


def test_importing_every_module_changes_nothing_in_torch_or_dynamo(tmp_path):
    """Every module: some load dynamo (before the snapshot), whose callbacks and allow-list
    mixprec must leave alone too."""
    dependencies = _child("dependencies", "every")
    if "torch._dynamo" not in dependencies:  # loaded by an extra's framework where installed:
        dependencies.insert(0, "torch._dynamo")  # loaded by hand otherwise, so it is checked
    path = tmp_path / "dependencies.json"
    path.write_text(json.dumps(dependencies))
    assert _child("import", "every", str(path)) == []


@pytest.mark.parametrize(
    ("how", "registered"),
    [
        ("region", ["optimizer post-step hook", "autocast kernels", "dynamo ready"]),
        ("boundary", ["optimizer post-step hook", "autocast kernels", "dynamo ready"]),
        ("optimizer", ["optimizer post-step hook", "clipping", "dynamo ready"]),
        ("compiled region", ["optimizer post-step hook", "autocast kernels", "dynamo ready"]),
    ],
)
def test_mixprec_registers_once_at_its_first_use(how, registered):
    assert _child("enable", how) == registered


def test_torch_clipping_on_o2_parameters_reaches_the_masters_or_says_why_not():
    assert _child("clip") == ["warned: clip_by_name in your script is t", "clipped the masters"]


def test_plain_training_is_bitwise_the_same_after_mixprec_was_used(tmp_path):
    ref, got = tmp_path / "plain.pt", tmp_path / "after_mixprec.pt"
    _child("train", "plain", str(ref))
    _child("train", "mixprec", str(got))
    want, have = torch.load(ref), torch.load(got)
    assert want.keys() == have.keys()
    for key in want:
        assert torch.equal(want[key], have[key]), key


if __name__ == "__main__":
    main(sys.argv[1:])
