"""The package's shape: no import circles, a core that imports no tool, the public names and
the old module paths that users may have imported."""

from __future__ import annotations

import ast
import importlib
import pathlib
import pickle
import warnings

import pytest
import torch

import mixprec
from mixprec import _moved

PKG = pathlib.Path(mixprec.__file__).resolve().parent

# The public API as it was before the package was split into subpackages, plus what was added
# since (``amp``, the torch.amp drop-in): it must not shrink.
PUBLIC = set(
    """Footprint LossScaleOptimizer LossScaler MixedPrecisionOptimizer NonFiniteError
    NonFiniteLocator OpStats Policy RangeAudit TunePlan amp autocast cast_rules check convert
    FP8Config FP8Plan fp8_plan
    default_dtype export footprint for_inference fp32_state_dict get_policy global_policy
    initialize lint locate_nonfinite op_stats policy_scope range_audit register_norm register_op
    scale_loss set_global_policy set_policy stochastic_round tune""".split()  # noqa: SIM905
)


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = ("mixprec", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = PKG) -> dict[str, set[str]]:
    """Module -> the mixprec modules it imports, at module level or inside functions."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # ``from pkg import mod`` imports the submodule; ``from mod import name`` the module
                found = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            else:
                continue
            for target in found:
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                if target in modules and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_circle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_import_graph_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "mixprec"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from mixprec.tools import b\n")
    (pkg / "tools.py").write_text("from .core import a\n")
    graph = import_graph(pkg)
    assert graph["mixprec.core.a"] == {"mixprec.tools"}
    assert graph["mixprec.tools"] == {"mixprec.core.a"}
    assert find_cycle(graph) is not None


def test_no_import_circle_inside_mixprec():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


# what a training step runs: the core and the FP8 package its engine calls
_STEP = ("mixprec.core", "mixprec.fp8")


def test_the_core_imports_nothing_above_it():
    graph = import_graph()
    core = [m for m in graph if m.startswith(_STEP)]
    assert "mixprec.core.engine" in core and "mixprec.core.optimizer" in core
    assert "mixprec.fp8.layers" in core
    upward = {m: sorted(t for t in graph[m] if not t.startswith(_STEP)) for m in core}
    assert not any(upward.values()), {m: t for m, t in upward.items() if t}


def test_fp8_is_one_package_that_imports_only_the_cores_leaves():
    graph = import_graph()
    fp8 = [m for m in graph if m.startswith("mixprec.fp8")]
    outside = {t for m in fp8 for t in graph[m] if not t.startswith("mixprec.fp8")}
    assert outside <= {"mixprec.core.hardware", "mixprec.core.policy"}, outside
    assert not [m for m in graph if m.startswith("mixprec.core.float8")]


def test_no_module_imports_the_package_root_that_the_root_imports():
    graph = import_graph()
    below_root = set(graph["mixprec"])
    assert not [m for m in below_root if "mixprec" in graph[m]]


def test_public_names_import_from_mixprec_as_before():
    assert set(mixprec.__all__) >= PUBLIC
    for name in mixprec.__all__:
        assert getattr(mixprec, name) is not None
    assert callable(mixprec.initialize) and callable(mixprec.export)  # not the old modules
    assert callable(mixprec.range_audit) and callable(mixprec.footprint)


def _fresh(old: str) -> _moved._MovedModule:
    proxy = importlib.import_module(f"mixprec.{old}")
    assert isinstance(proxy, _moved._MovedModule)
    proxy.__dict__["_warned"] = False  # an earlier test may have used it
    return proxy


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_old_module_paths_work_and_warn(old):
    proxy = _fresh(old)
    new = importlib.import_module(_moved.MOVED[old])
    public = getattr(new, "__all__", None) or [n for n in vars(new) if not n.startswith("_")]
    name = min(public)
    with pytest.warns(DeprecationWarning, match=f"mixprec.{old} is deprecated.*{new.__name__}"):
        value = getattr(proxy, name)
    assert value is getattr(new, name)


def test_from_import_through_an_old_path_warns_and_gives_the_same_objects():
    _fresh("policy")
    _fresh("loss_scale")
    with pytest.warns(DeprecationWarning, match="mixprec.core.policy"):
        from mixprec.policy import Policy
    assert Policy is mixprec.Policy
    import mixprec.loss_scale as old  # importing alone does not warn: using it does

    with pytest.warns(DeprecationWarning, match="mixprec.core.loss_scale"):
        scaler = old.LossScaler
    assert scaler is mixprec.LossScaler


def test_objects_pickled_under_an_old_path_load():
    scaler = mixprec.LossScaler(init_scale=2.0**10)
    data = pickle.dumps(scaler, protocol=2)  # module names as plain text lines
    assert b"mixprec.core.loss_scale\n" in data
    old = data.replace(b"mixprec.core.loss_scale\n", b"mixprec.loss_scale\n")
    assert old != data
    _fresh("loss_scale")
    with pytest.warns(DeprecationWarning, match="mixprec.loss_scale is deprecated"):
        loaded = pickle.loads(old)
    assert type(loaded) is mixprec.LossScaler and loaded.scale == 2.0**10


def test_writes_through_an_old_path_reach_the_module_that_runs(monkeypatch):
    from mixprec.core import hardware

    proxy = _fresh("hardware")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        monkeypatch.setattr(proxy, "default_dtype", lambda device=None: torch.float16)
    assert hardware.default_dtype() is torch.float16


def test_public_names_and_the_new_paths_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        importlib.import_module("mixprec.core.engine")
        importlib.import_module("mixprec.numerics.range_audit")
        from mixprec.inference import for_inference  # noqa: F401

        assert mixprec.tune is mixprec.numerics.tuning.tune
