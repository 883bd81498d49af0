"""The package's shape: no import circles, a core that imports no tool, the public names and
where each tool lives."""

from __future__ import annotations

import ast
import importlib
import pathlib
import warnings

import pytest

import mixprec

PKG = pathlib.Path(mixprec.__file__).resolve().parent

# The public names: what a training script needs (the Recipe, the Policy and the names that
# apply them); the tools live in subpackages.
PUBLIC = set(
    """ActivationConfig FP8Config LossScaling Policy Recipe autocast check convert default_dtype
    for_inference fp32_state_dict get_policy global_policy initialize policy_scope register_norm
    register_op scale_loss set_global_policy set_policy""".split()  # noqa: SIM905
)
#: subpackage -> the tools it exports
TOOLS = {
    "mixprec.numerics": """Footprint NonFiniteError NonFiniteLocator OpStats RangeAudit TunePlan
    cast_rules footprint lint locate_nonfinite op_stats range_audit stochastic_round tune""",
    "mixprec.inference": "export for_inference",
}


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
    (pkg / "_core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_core" / "__init__.py").write_text("")
    (pkg / "_core" / "a.py").write_text("def f():\n    from mixprec.tools import b\n")
    (pkg / "tools.py").write_text("from ._core import a\n")
    graph = import_graph(pkg)
    assert graph["mixprec._core.a"] == {"mixprec.tools"}
    assert graph["mixprec.tools"] == {"mixprec._core.a"}
    assert find_cycle(graph) is not None


def test_no_import_circle_inside_mixprec():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


# what a training step runs: the core and the FP8 package its engine calls
_STEP = ("mixprec._core", "mixprec.fp8")


def test_the_core_imports_nothing_above_it():
    graph = import_graph()
    core = [m for m in graph if m.startswith(_STEP)]
    assert "mixprec._core.engine" in core and "mixprec._core.optimizer" in core
    assert "mixprec.fp8.layers" in core
    upward = {m: sorted(t for t in graph[m] if not t.startswith(_STEP)) for m in core}
    assert not any(upward.values()), {m: t for m, t in upward.items() if t}


def test_fp8_is_one_package_that_imports_only_the_cores_leaves():
    graph = import_graph()
    fp8 = [m for m in graph if m.startswith("mixprec.fp8")]
    outside = {t for m in fp8 for t in graph[m] if not t.startswith("mixprec.fp8")}
    assert outside <= {
        "mixprec._core.hardware",
        "mixprec._core.policy",
        "mixprec._core._warnings",
    }, outside
    assert not [m for m in graph if m.startswith("mixprec._core.float8")]


def test_no_module_imports_the_package_root_that_the_root_imports():
    graph = import_graph()
    below_root = set(graph["mixprec"])
    assert not [m for m in below_root if "mixprec" in graph[m]]


def test_the_public_names_are_the_twenty_a_training_script_needs():
    assert set(mixprec.__all__) == PUBLIC and len(mixprec.__all__) <= 20
    for name in mixprec.__all__:
        assert getattr(mixprec, name) is not None
    assert callable(mixprec.initialize) and callable(mixprec.inference.export)  # not modules


@pytest.mark.parametrize("package", sorted(TOOLS))
def test_each_tool_lives_in_its_subpackage(package):
    module = importlib.import_module(package)
    names = set(TOOLS[package].split())
    assert names <= set(module.__all__)
    assert all(not isinstance(getattr(module, n), type(mixprec)) for n in names)  # not modules
    assert not names & set(mixprec.__all__) - {"for_inference"}


@pytest.mark.parametrize("old", ["policy", "loss_scale", "hardware", "tuning", "initialize"])
def test_the_flat_module_paths_of_an_unreleased_layout_are_gone(old):
    """Nothing was released under ``mixprec.<module>``: no alias keeps those paths alive."""
    with pytest.raises(ModuleNotFoundError, match=f"No module named 'mixprec.{old}'"):
        importlib.import_module(f"mixprec.{old}")


def test_public_names_and_the_new_paths_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        importlib.import_module("mixprec._core.engine")
        importlib.import_module("mixprec.numerics.range_audit")
        from mixprec.inference import for_inference  # noqa: F401

        assert mixprec.numerics.tune is mixprec.numerics.tuning.tune


def test_the_house_reads_in_an_hour():
    """No function over 80 lines, no module over 500 but the cast table's data, 20 public
    names at most (``tools/house_metrics.py`` prints the same counts)."""
    import importlib.util

    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("house_metrics", root / "tools/house_metrics.py")
    metrics = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(metrics)
    counts = metrics.measure()
    assert counts["functions_over_80"] == []
    assert [name for name, _ in counts["modules_over_500"]] == ["mixprec._core.cast_table"]
    assert counts["import_cycles"] == []
    assert counts["top_level_public"] <= 20
