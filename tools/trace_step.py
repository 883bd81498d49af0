"""How much of the package one training step runs through: the house on the step's path.

    python tools/trace_step.py                      # both steps, one line each
    python tools/trace_step.py --by-file            # per file, largest first
    python tools/trace_step.py --functions mixprec/_core/optimizer.py
    python tools/trace_step.py --step lean --json   # one step, as JSON

Two steps on a tiny model (Linear(32, 64), GELU, LayerNorm(64), Linear(64, 4); AdamW) in bf16,
each traced with :func:`sys.settrace` (and :func:`threading.settrace`) in a fresh interpreter
of its own, so that what happens at first use -- kernels registered with torch, the C library
of the fused update built or loaded -- is on the path as a user's first step meets it:

* ``O2``: ``mixprec.initialize(model, opt, "O2", torch.bfloat16)``, a forward,
  ``opt.backward(loss)``, ``opt.clip_grad_norm_(1.0)``, ``opt.step()``;
* ``lean``: ``initialize`` with ``"lean"``, then three steps (forward, backward, clip, step,
  ``zero_grad``), so that the fused update and the first step's decision of ``gradients="auto"``
  run (the clip keeps them coded in 8 bits); its C source
  (a ``.c`` file of the package that an entered module names) is reported beside it.

Nothing in mixprec is switched: the default configuration a user gets (the test suite's
conftest, which pins thread counts, is not imported).

What counts. A *file entered* is a mixprec module in which any code ran during the step (a
module imported at first use counts). A *function executed* is a ``def`` or a ``lambda``
whose code ran, each counted once however often it ran. Lines are:

* the module docstring of every file entered (its first line to its closing quotes);
* the source lines of every function executed, its definition from the ``def`` line to its
  last line as :mod:`ast` gives it (decorators left out, its own docstring in). A function
  nested in another executed function lies inside that one's lines and adds none (a file's
  function lines are the union of the spans); a nested function whose outer one did not run
  in the step (a decorator's wrapper made at import) counts its own span.

Not counted as lines: comprehensions and generator expressions (inside their function's span
already), class bodies and module-level code (they run once, at import; the functions they
call during the step are counted), and methods a dataclass generates (their code has no
mixprec source file). Code that ran but matches nothing in its file's tree (the file changed
since it was imported) is listed as ``unmatched`` instead of dropped; the warnings a step
raises are caught and listed as ``warnings`` (both in the JSON).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEPS = {
    "O2": "initialize; forward, backward, clip, step",
    "lean": "initialize; 3 x (forward, backward, clip, step, zero_grad)",
}
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
NOT_FUNCTIONS = {"<module>", "<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>"}


# -- tracing ----------------------------------------------------------------------------------


def run_step(step: str) -> set[CodeType]:
    """The training step ``step`` (a key of :data:`STEPS`), from ``initialize`` on."""
    import torch

    import mixprec

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
    with Tracing() as codes:
        model, opt = mixprec.initialize(model, opt, step, torch.bfloat16)
        for _ in range(1 if step == "O2" else 3):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.backward(loss)
            opt.clip_grad_norm_(1.0)
            opt.step()
            if step == "lean":
                opt.zero_grad()
    return codes


class Tracing:
    """Collects the code objects of the package that run inside the ``with`` block, on this
    thread and on threads started inside it; the tracers in place before are put back."""

    def __init__(self) -> None:
        self.codes: set[CodeType] = set()
        self._package = str(package_dir()) + os.sep
        self._seen: dict[CodeType, bool] = {}

    def _trace(self, frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code  # the global tracer is called on "call" events only
        mine = self._seen.get(code)
        if mine is None:
            mine = self._seen[code] = os.path.realpath(code.co_filename).startswith(self._package)
        if mine:
            self.codes.add(code)

    def __enter__(self) -> set[CodeType]:
        self._before = sys.gettrace(), threading.gettrace()
        threading.settrace(self._trace)
        sys.settrace(self._trace)
        return self.codes

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self._before[0])
        threading.settrace(self._before[1])


def package_dir() -> Path:
    import mixprec

    return Path(mixprec.__file__).resolve().parent


# -- counting ---------------------------------------------------------------------------------


class Source:
    """One module's syntax tree: its docstring's lines and the node of each code object."""

    def __init__(self, path: Path) -> None:
        self.text = path.read_text()
        tree = ast.parse(self.text, str(path))
        first = tree.body[0] if tree.body else None
        is_doc = ast.get_docstring(tree, clean=False) is not None
        self.docstring_lines = first.end_lineno - first.lineno + 1 if is_doc else 0
        self.parent: dict[ast.AST, ast.AST] = {}
        self.nodes: dict[tuple[int, str], ast.AST] = {}
        self.classes: set[tuple[int, str]] = set()
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
            if isinstance(node, ast.ClassDef):
                start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                self.classes.add((start, node.name))
            elif isinstance(node, FUNCTIONS):
                # a code object's first line is its first decorator's
                decorators = getattr(node, "decorator_list", [])
                start = decorators[0].lineno if decorators else node.lineno
                self.nodes[start, getattr(node, "name", "<lambda>")] = node

    def function(self, code: CodeType) -> ast.AST | None:
        """The ``def`` or ``lambda`` of ``code``, or None (module, class body, comprehension)."""
        return self.nodes.get((code.co_firstlineno, code.co_name))

    def unmatched(self, code: CodeType) -> bool:
        """Whether ``code`` is neither a function, a module, a class body nor a comprehension
        of this file (the file changed since it was imported: say so rather than drop it)."""
        key = code.co_firstlineno, code.co_name
        return not (key in self.nodes or key in self.classes or code.co_name in NOT_FUNCTIONS)

    def qualname(self, node: ast.AST) -> str:
        """``node``'s ``__qualname__``, read from the tree (Python 3.10 has no co_qualname)."""
        parts = [getattr(node, "name", "<lambda>")]
        node = self.parent.get(node)
        while node is not None and not isinstance(node, ast.Module):
            if isinstance(node, FUNCTIONS):
                parts.append(f"{getattr(node, 'name', '<lambda>')}.<locals>")
            elif isinstance(node, ast.ClassDef):
                parts.append(node.name)
            node = self.parent.get(node)
        return ".".join(reversed(parts))

    def enclosing(self, node: ast.AST, executed: set[ast.AST]) -> ast.AST | None:
        """The nearest function around ``node`` that ran too, or None."""
        node = self.parent.get(node)
        while node is not None and node not in executed:
            node = self.parent.get(node)
        return node


def count_file(path: Path, codes: list[CodeType]) -> dict[str, Any]:
    """One entered file: its docstring lines, the functions that ran and their lines."""
    src = Source(path)
    executed = {src.function(c) for c in codes} - {None}
    functions, covered = [], set()
    for node in sorted(executed, key=lambda n: (n.lineno, n.col_offset)):
        span = range(node.lineno, node.end_lineno + 1)
        covered |= set(span)
        outer = src.enclosing(node, executed)
        functions.append(
            {
                "name": src.qualname(node),
                "line": node.lineno,
                "lines": len(span),
                "within": None if outer is None else src.qualname(outer),
            }
        )
    return {
        "docstring_lines": src.docstring_lines,
        "function_lines": len(covered),
        "functions": len(functions),
        "lines": src.docstring_lines + len(covered),
        "executed": functions,
        "unmatched": sorted(f"{c.co_name}:{c.co_firstlineno}" for c in codes if src.unmatched(c)),
        "text": src.text,
    }


def c_sources(texts: list[str]) -> dict[str, int]:
    """The package's C files that an entered module names, with their line counts."""
    root = package_dir()
    return {
        str(path.relative_to(root.parent)): path.read_text().count("\n")
        for path in sorted(root.rglob("*.c"))
        if any(path.name in text for text in texts)
    }


def measure(step: str) -> dict[str, Any]:
    """Trace step ``step`` in this process and count what ran. First use happens once per
    process: call this in a fresh interpreter (:func:`fresh` does) for the figures of a
    user's first step."""
    with warnings.catch_warnings(record=True) as caught:
        codes = run_step(step)
    root = package_dir()
    by_file: dict[Path, list[CodeType]] = {}
    for code in codes:
        by_file.setdefault(Path(os.path.realpath(code.co_filename)), []).append(code)
    files = {str(p.relative_to(root.parent)): count_file(p, c) for p, c in by_file.items()}
    texts = [f.pop("text") for f in files.values()]
    rows = sorted(files.items(), key=lambda kv: (-kv[1]["lines"], kv[0]))
    return {
        "step": step,
        "what": STEPS[step],
        "lines": sum(f["lines"] for f in files.values()),
        "files_entered": len(files),
        "functions_executed": sum(f["functions"] for f in files.values()),
        "docstring_lines": sum(f["docstring_lines"] for f in files.values()),
        "function_lines": sum(f["function_lines"] for f in files.values()),
        "c_source": c_sources(texts),
        "warnings": sorted({str(w.message).split("\n")[0] for w in caught}),
        "files": dict(rows),
    }


def fresh(step: str, timeout: float | None = None) -> dict[str, Any]:
    """:func:`measure` of ``step`` in a new interpreter (raises if it fails)."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--here", step],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"tracing the {step} step failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


# -- printing ---------------------------------------------------------------------------------


def summary(m: dict[str, Any]) -> str:
    line = (
        f"{m['step']} step ({m['what']}): {m['lines']:,} lines in {m['files_entered']} files, "
        f"{m['functions_executed']} functions ({m['docstring_lines']:,} module docstring "
        f"lines, {m['function_lines']:,} function lines)"
    )
    for path, n in m["c_source"].items():
        line += f"\n    C source beside it: {path} {n:,} lines"
    return line


def print_by_file(m: dict[str, Any]) -> None:
    print(summary(m))
    print(f"    {'lines':>6} {'docstring':>9} {'fn lines':>8} {'functions':>9}  file")
    for path, f in m["files"].items():
        print(
            f"    {f['lines']:>6,} {f['docstring_lines']:>9,} {f['function_lines']:>8,} "
            f"{f['functions']:>9}  {path}"
        )


def print_functions(m: dict[str, Any], file: str) -> None:
    matches = [p for p in m["files"] if p == file or p.endswith("/" + file.lstrip("/"))]
    if len(matches) != 1:
        what = "not entered" if not matches else f"ambiguous: {', '.join(matches)}"
        print(f"{m['step']} step: {file}: {what}")
        return
    f = m["files"][matches[0]]
    print(
        f"{m['step']} step, {matches[0]}: {f['lines']:,} lines = {f['docstring_lines']:,} "
        f"docstring + {f['function_lines']:,} in {f['functions']} functions"
    )
    print(f"    {'line':>5} {'lines':>5}  function")
    for fn in f["executed"]:
        inside = f"  (inside {fn['within']}: counted there)" if fn["within"] else ""
        print(f"    {fn['line']:>5} {fn['lines']:>5}  {fn['name']}{inside}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--step", choices=[*STEPS, "both"], default="both")
    p.add_argument("--json", action="store_true")
    p.add_argument("--by-file", action="store_true", help="per file, largest first")
    p.add_argument("--functions", metavar="FILE", help="the functions of FILE that ran")
    p.add_argument("--here", choices=STEPS, help=argparse.SUPPRESS)  # fresh()'s child
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.here:
        print(json.dumps(measure(args.here)))
        return
    results = [fresh(s) for s in (STEPS if args.step == "both" else [args.step])]
    if args.json:
        print(json.dumps({m["step"]: m for m in results}, indent=1))
        return
    for i, m in enumerate(results):
        if args.functions or args.by_file:
            print("\n" * bool(i), end="")
        if args.functions:
            print_functions(m, args.functions)
        elif args.by_file:
            print_by_file(m)
        else:
            print(summary(m))


if __name__ == "__main__":
    main()
