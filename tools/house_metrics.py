"""Counts that say whether the package can be read in an hour.

    python tools/house_metrics.py            # a table
    python tools/house_metrics.py --json     # the same as JSON

Public names (top level and across modules), package lines, modules over 500 lines, functions
over 80 lines, and import cycles between the package's modules (imports at module level, the
ones that run at ``import mixprec``).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mixprec"
MODULE_LIMIT, FUNCTION_LIMIT = 500, 80


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def long_functions(tree: ast.AST, name: str) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > FUNCTION_LIMIT:
                out.append((f"{name}.{node.name}", length))
    return out


def top_level_imports(tree: ast.Module, name: str, is_package: bool) -> set[str]:
    """Package modules imported at module level (not inside functions or TYPE_CHECKING)."""
    found: set[str] = set()
    base = name if is_package else name.rpartition(".")[0]
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in [node] if not isinstance(node, (ast.Try, ast.If)) else ast.walk(node):
            if isinstance(sub, ast.Import):
                found |= {a.name for a in sub.names if a.name.startswith("mixprec")}
            elif isinstance(sub, ast.ImportFrom):
                if sub.level:
                    anchor = base.split(".")
                    anchor = anchor[: len(anchor) - sub.level + 1]
                    mod = ".".join(anchor + ([sub.module] if sub.module else []))
                else:
                    mod = sub.module or ""
                if mod.startswith("mixprec"):  # resolved in measure: a submodule, else mod
                    found |= {f"{mod}:{a.name}" for a in sub.names}
    return found


def public_names(tree: ast.Module) -> list[str]:
    """The module's ``__all__``, read from its source: nothing is imported, so a module whose
    framework is an optional extra (``mixprec.integrations.huggingface``) counts without it."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    return []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def measure() -> dict[str, object]:
    lines = 0
    big_modules, big_functions, public = [], [], 0
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        n = text.count("\n")
        lines += n
        name = module_name(path)
        tree = ast.parse(text)
        if n > MODULE_LIMIT:
            big_modules.append((name, n))
        big_functions += long_functions(tree, name)
        graph[name] = top_level_imports(tree, name, path.name == "__init__.py")
        if not any(part.startswith("_") and part != "__init__" for part in path.parts[-3:]):
            public += len(public_names(tree))
    modules = set(graph)

    # an import of a package's submodule also runs the package: an edge to each
    def resolve(target: str) -> str:
        mod, _, attr = target.partition(":")
        return f"{mod}.{attr}" if f"{mod}.{attr}" in modules else mod

    graph = {k: {resolve(m) for m in v} & modules - {k} for k, v in graph.items()}
    import mixprec

    return {
        "top_level_public": len(mixprec.__all__),
        "public_across_modules": public,
        "package_lines": lines,
        "modules_over_500": sorted(big_modules, key=lambda x: -x[1]),
        "functions_over_80": sorted(big_functions, key=lambda x: -x[1]),
        "import_cycles": cycles(graph),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    m = measure()
    if args.json:
        print(json.dumps(m, indent=1))
        return
    for key, value in m.items():
        if isinstance(value, list):
            print(f"{key}: {len(value)}")
            for item in value:
                print(f"    {item}")
        else:
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
