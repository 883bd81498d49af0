"""Run NVIDIA Apex's own L0 amp tests (``tests/L0/run_amp``) on CPU against mixprec's Apex shim.

    python tools/run_apex_l0.py /tmp/apex/tests/L0/run_amp          # counts + non-passing tests
    python tools/run_apex_l0.py /tmp/apex/tests/L0/run_amp -v       # every test's outcome
    python tools/run_apex_l0.py /tmp/apex/tests/L0/run_amp -- -k cache -x   # extra pytest args

Get the directory from an Apex checkout that still has ``apex/amp`` (the parent of the commit
that removed it), e.g. ``git archive <parent> tests/L0/run_amp | tar -x -C /tmp/apex``. Nothing
of Apex is kept in this repository: the runner reads that directory at run time.

What it does, and nothing more:

1. copies the directory to a temporary one;
2. rewrites device names only -- ``"cuda"`` / ``'cuda'`` to ``"cpu"``, ``.cuda()`` to ``.cpu()``,
  ``torch.cuda.XTensor`` (types and type strings) to ``torch.XTensor``; no assertion is touched;
3. adds a ``conftest.py`` that calls :func:`mixprec.compat.apex.install` (so ``import apex``
   resolves to mixprec's shim) and puts the directory on ``sys.path`` (the tests import
   ``utils`` as a top-level module, as Apex's own runner does);
4. runs pytest there and prints pass/skip/fail counts, then the tests that did not pass.

Tests that need Apex's compiled extensions (``amp_C``, ``apex.optimizers.FusedSGD``,
``apex.multi_tensor_apply``) skip themselves when those are missing, as they do in Apex.
Exit status: 0 when nothing failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (pattern, replacement): device names only.
REWRITES = [
    (re.compile(r"torch\.cuda\.(\w+Tensor)\b"), r"torch.\1"),  # types and 'torch.cuda.X' strings
    (re.compile(r"\.cuda\(\)"), ".cpu()"),
    (re.compile(r"""(["'])cuda\1"""), r"\1cpu\1"),
]

CONFTEST = '''\
"""Added by mixprec's tools/run_apex_l0.py: ``import apex`` is mixprec's shim."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mixprec.compat.apex

mixprec.compat.apex.install()
'''


def rewrite(text: str) -> str:
    """Replace CUDA device names with CPU ones."""
    for pattern, repl in REWRITES:
        text = pattern.sub(repl, text)
    return text


def prepare(src: Path, dst: Path) -> list[str]:
    """Copy ``src`` into ``dst`` with device names rewritten; return the files changed."""
    changed = []
    for path in sorted(src.iterdir()):
        if path.suffix != ".py":
            continue
        text = path.read_text()
        new = rewrite(text)
        if new != text:
            changed.append(path.name)
        (dst / path.name).write_text(new)
    (dst / "conftest.py").write_text(CONFTEST)
    return changed


def test_names(path: Path) -> list[str]:
    """``Class::test_method`` for every unittest test method defined in a file."""
    tree = ast.parse(path.read_text())
    return [
        f"{node.name}::{item.name}"
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, ast.FunctionDef) and item.name.startswith("test")
    ]


def outcomes(junit: Path, work: Path) -> dict[str, tuple[str, str]]:
    """``{test id: (outcome, message)}`` from a pytest JUnit XML report. A file that fails to
    import counts each of its tests as an error (pytest reports the file once)."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "").strip().splitlines()[:1]
                message = message[0][:160] if message else ""
        if not case.get("classname") and (work / f"{case.get('name')}.py").is_file():
            module = case.get("name")
            for name in test_names(work / f"{module}.py"):
                out[f"{module}.{name}"] = ("error", f"{module}.py did not import")
            continue
        out[f"{case.get('classname', '')}::{case.get('name', '')}"] = (outcome, message)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("run_amp", type=Path, help="an extracted Apex tests/L0/run_amp directory")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every test's outcome")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.pytest_args = argv[cut + 1 :]  # extra pytest arguments, after --
    src = args.run_amp.resolve()
    if not (src / "utils.py").is_file() or not any(src.glob("test_*.py")):
        parser.error(
            f"{src} does not look like Apex's tests/L0/run_amp (no utils.py / test_*.py); "
            "extract it with: git archive <commit> tests/L0/run_amp | tar -x -C DIR"
        )
    tmp = Path(tempfile.mkdtemp(prefix="apex_l0_"))
    try:
        work = tmp / "run_amp"
        work.mkdir()
        changed = prepare(src, work)
        print(f"copied {src} -> {work}; device names rewritten in {len(changed)} files")
        junit = tmp / "report.xml"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--continue-on-collection-errors",
            "--rootdir",
            str(work),
            f"--junitxml={junit}",
            str(work),
            *args.pytest_args,
        ]
        proc = subprocess.run(cmd, check=False, cwd=work, env=env, capture_output=True, text=True)
        if not junit.is_file():
            print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
            return 1
        results = outcomes(junit, work)
        counts = dict.fromkeys(("passed", "skipped", "failed", "error"), 0)
        for outcome, _ in results.values():
            counts[outcome] += 1
        print(
            f"{len(results)} tests: {counts['passed']} passed, {counts['skipped']} skipped, "
            f"{counts['failed']} failed, {counts['error']} errors"
        )
        for name, (outcome, message) in sorted(results.items()):
            if args.verbose or outcome in ("failed", "error"):
                print(f"  {outcome:8s} {name}  {message}")
        if args.keep:
            print(f"kept {tmp}")
        return 0 if counts["failed"] == counts["error"] == 0 else 1
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
