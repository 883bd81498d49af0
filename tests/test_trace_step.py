"""``tools/trace_step.py``: the lines one training step runs through, counted consistently."""

from __future__ import annotations

import importlib.util
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("trace_step", ROOT / "tools/trace_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def o2():
    """The O2 step, traced in a fresh interpreter (this process has done first use already,
    and the suite's conftest switched the fused update off)."""
    return _tool().fresh("O2", timeout=120)


def test_the_total_is_the_sum_of_the_files(o2):
    files = o2["files"].values()
    assert (
        o2["lines"]
        == sum(f["lines"] for f in files)
        == o2["docstring_lines"] + o2["function_lines"]
    )
    assert o2["files_entered"] == len(o2["files"])
    assert o2["functions_executed"] == sum(f["functions"] for f in files)
    for f in files:
        assert f["lines"] == f["docstring_lines"] + f["function_lines"]
        assert f["functions"] == len(f["executed"]) > 0
        assert f["unmatched"] == []
        # a nested function adds nothing where its outer one ran; otherwise its own span
        own = sum(fn["lines"] for fn in f["executed"] if fn["within"] is None)
        assert f["function_lines"] == own
    lines = [f["lines"] for f in files]
    assert lines == sorted(lines, reverse=True)  # largest first


def test_every_file_is_a_mixprec_module_and_the_core_is_there(o2):
    for path, f in o2["files"].items():
        source = ROOT / path
        assert path.startswith("mixprec/") and path.endswith(".py") and source.is_file()
        n = source.read_text().count("\n") + 1
        assert all(fn["line"] + fn["lines"] - 1 <= n for fn in f["executed"])
    for module in ["_initialize.py", "recipe.py", "_core/optimizer.py", "_core/engine.py"]:
        assert f"mixprec/{module}" in o2["files"]
    names = {fn["name"] for fn in o2["files"]["mixprec/_core/optimizer.py"]["executed"]}
    assert {"MixedPrecisionOptimizer.backward", "MixedPrecisionOptimizer.step"} <= names
    assert {fn["name"] for fn in o2["files"]["mixprec/_initialize.py"]["executed"]} >= {
        "initialize"
    }


def test_a_file_counts_def_to_end_once_and_nested_functions_inside_their_outer(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text(
        textwrap.dedent(
            '''\
            """Two
            lines."""


            def deco(fn):
                return fn


            @deco
            def outer():
                def inner():
                    return [i for i in range(2)]

                return inner()


            def never():
                pass


            def wrapper_maker():
                def wrapped():
                    return 1

                return wrapped
            '''
        )
    )
    scope = {}
    exec(compile(path.read_text(), str(path), "exec"), scope)
    codes, todo = [scope["wrapper_maker"]().__code__], [scope["outer"].__code__]
    while todo:  # outer, inner and the comprehension in inner
        codes.append(todo.pop())
        todo += [c for c in codes[-1].co_consts if hasattr(c, "co_name")]
    counted = _tool().count_file(path, codes)
    assert counted["docstring_lines"] == 2
    # outer: its def to its end (5 lines, decorator left out); inner lies inside it; wrapped
    # ran without its outer function: its own 2 lines; the comprehension is not a function
    assert counted["function_lines"] == 5 + 2
    by_name = {fn["name"]: fn for fn in counted["executed"]}
    assert set(by_name) == {"outer", "outer.<locals>.inner", "wrapper_maker.<locals>.wrapped"}
    assert by_name["outer"]["line"] == 10 and by_name["outer"]["lines"] == 5
    assert by_name["outer.<locals>.inner"]["within"] == "outer"
    assert by_name["wrapper_maker.<locals>.wrapped"]["within"] is None
