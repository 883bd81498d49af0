"""The docs are tested like code: every ```python block runs, the op table is generated.

Blocks of one file run in order in one shared namespace, as a reader following along would run
them, in a temporary working directory (examples may write files). A block directly preceded by
``<!-- not run: <reason> -->`` (it needs torchrun, a GPU or a network) is only parsed.
"""

from __future__ import annotations

import ast
import pathlib
import re
import runpy
import sys
import textwrap

import pytest
import torch
from extras import EXTRA, install_hint

import mixprec

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOC_FILES = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

# a fenced python block, possibly indented (inside a list item); the closing fence has the same
# indent as the opening one
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>\S.*?)\s*-->")
# "issue #12", "#12", "(#7)", "apex#180" -- but not an HTML entity (&#39;)
ISSUE_REF = re.compile(r"(?<!&)#\d+\b")


def code_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(first code line, dedented source, not-run reason or None) for every python block."""
    blocks = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 2  # the line after the opening fence
        body = m.group("body")
        indent = m.group("indent")
        if indent:
            body = "".join(ln.removeprefix(indent) for ln in body.splitlines(keepends=True))
        before = text[: m.start()].rstrip().rsplit("\n", 1)[-1]
        marker = NOT_RUN.search(before)
        blocks.append((line, textwrap.dedent(body), marker.group("reason") if marker else None))
    return blocks


def missing_extra(exc: BaseException) -> str | None:
    """The optional package (one of an extra's, see tests/extras.py) whose absence raised
    ``exc`` or its cause, else None."""
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            top = exc.name.partition(".")[0]
            return top if top in EXTRA else None
        exc = exc.__cause__
    return None


def _names(tree: ast.AST, ctx: type) -> set[str]:
    """Names a block stores (``ast.Store``: assignments, imports, defs) or loads."""
    found = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}
    if ctx is ast.Store:
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                found |= {(a.asname or a.name).partition(".")[0] for a in n.names}
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(n.name)
    return found


def run_blocks(name: str, text: str, skipped: list[str] | None = None) -> dict:
    """Run (or only parse) a file's blocks in order in one namespace; return the namespace.

    With a ``skipped`` list, a block that needs a package of an extra that is not installed is
    recorded there instead of failing, and so is every later block that uses a name it binds;
    the others still run (the light ``.[test]`` install checks what it can)."""
    namespace: dict = {"__name__": "__docs__"}
    unbound: set[str] = set()  # names the skipped blocks would have bound
    for line, source, reason in code_blocks(text):
        where = f"{name}, block at line {line}"
        try:
            tree = ast.parse(source, filename=where)
        except SyntaxError as e:
            raise AssertionError(f"{where} does not parse: {e}") from e
        if reason is not None:
            continue
        if skipped is not None and _names(tree, ast.Load) & unbound:
            skipped.append(f"line {line} (uses {sorted(_names(tree, ast.Load) & unbound)})")
            unbound |= _names(tree, ast.Store)
            continue
        try:
            exec(compile(tree, where, "exec"), namespace)
        except Exception as e:
            module = missing_extra(e)
            if skipped is None or module is None:
                raise AssertionError(f"{where} failed: {type(e).__name__}: {e}") from e
            skipped.append(f"line {line} ({install_hint(module)})")
            unbound |= _names(tree, ast.Store)
    return namespace


FILES_WITH_CODE = [p for p in DOC_FILES if p.exists() and code_blocks(p.read_text())]


@pytest.mark.parametrize("path", FILES_WITH_CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_runs(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    policy = mixprec.global_policy()
    skipped: list[str] = []
    name = str(path.relative_to(ROOT))
    try:
        run_blocks(name, path.read_text(), skipped)
    finally:
        mixprec.set_global_policy(policy)
    if skipped:
        pytest.skip(f"{name}: the other blocks ran; skipped the blocks at {'; '.join(skipped)}")


def test_the_block_runner_shares_a_namespace_and_skips_marked_blocks():
    text = textwrap.dedent(
        """\
        ```python
        a = 2
        ```

        <!-- not run: needs a GPU -->
        ```python
        raise RuntimeError("must not run")
        ```

        - a list item:

          ```python
          b = a * 3
          ```
        """
    )
    blocks = code_blocks(text)
    assert [(line, reason) for line, _, reason in blocks] == [
        (2, None),
        (7, "needs a GPU"),
        (13, None),
    ]
    assert run_blocks("t.md", text)["b"] == 6
    with pytest.raises(AssertionError, match=r"t\.md, block at line 2 failed: NameError"):
        run_blocks("t.md", "```python\nundefined_name\n```\n")
    with pytest.raises(AssertionError, match=r"line 3 does not parse"):
        run_blocks("t.md", "<!-- not run: x -->\n```python\ndef (:\n```\n")


def test_a_block_needing_a_missing_extra_skips_it_and_its_users_only(monkeypatch):
    """A block that needs an extra's package which is not installed is skipped with the install
    line, and so is a later block using what it binds; independent blocks still run (and fail)."""
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import raises ModuleNotFoundError
    text = (
        "```python\na = 1\n```\n```python\nimport onnxruntime\nsess = 2\n```\n"
        "```python\nprint(sess)\n```\n```python\nb = a + 1\n```\n"
    )
    skipped: list[str] = []
    assert run_blocks("t.md", text, skipped)["b"] == 2
    assert skipped == [
        'line 5 (needs onnxruntime: pip install -e ".[test,inference]")',
        "line 9 (uses ['sess'])",
    ]
    with pytest.raises(AssertionError, match="ModuleNotFoundError"):  # without the list: fails
        run_blocks("t.md", text)
    with pytest.raises(AssertionError, match="NameError"):  # a missing name of its own: fails
        run_blocks("t.md", "```python\nundefined_name\n```\n", [])


def test_readme_examples_run_and_are_not_all_skipped():
    ran = [b for b in code_blocks(README.read_text()) if b[2] is None]
    assert len(ran) >= 5


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= 220, f"README.md has {lines} lines; keep it at most 220 (details go in docs/)"


@pytest.mark.parametrize("path", [p for p in DOC_FILES if p.exists()], ids=lambda p: p.name)
def test_docs_name_no_internal_paths_or_issue_numbers(path):
    text = path.read_text()
    assert "shared/" not in text, f"{path.name} names a path outside the repository (shared/...)"
    refs = [m.group(0) for m in ISSUE_REF.finditer(text)]
    assert not refs, f"{path.name} refers to issues {refs}: move that to benchmarks/notes/"
    assert not re.search(r"\bissue\s+#?\d", text, re.IGNORECASE), f"{path.name} cites an issue"


def test_op_table_is_generated_from_the_cast_table():
    gen = runpy.run_path(str(ROOT / "tools" / "gen_op_table.py"))
    text = gen["TARGET"].read_text()
    assert gen["render"](text) == text, "the op table is stale: run python tools/gen_op_table.py"


def test_readme_gives_the_test_command_ci_runs():
    text = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in text and "python -m pytest -q" in ci
    assert "mixprec demo" in text


def test_design_sections_cited_by_docstrings_exist():
    design = (ROOT / "docs" / "design.md").read_text()
    headings = set(re.findall(r"^## (.+)$", design, re.MULTILINE))
    cited = {
        (m.group(1), path.relative_to(ROOT).as_posix())
        for path in (ROOT / "mixprec").rglob("*.py")
        for m in re.finditer(r'design\.md``,\s*"([^"]+)"', path.read_text())
    }
    assert cited, "no module docstring cites docs/design.md: has the citation style changed?"
    missing = sorted((section, where) for section, where in cited if section not in headings)
    assert not missing, f"docstrings cite sections docs/design.md does not have: {missing}"


NOTES = ROOT / "benchmarks" / "notes"
LINK = re.compile(r"\]\((?P<url>[^)\s]+)\)")


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    heads = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def broken_links(path: pathlib.Path) -> list[str]:
    """The relative links of a markdown file whose file, or heading anchor, does not exist."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    broken = []
    for m in LINK.finditer(text):
        url = m.group("url")
        if re.match(r"[a-z]+:", url):  # http:, https:, mailto:
            continue
        target, _, anchor = url.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            broken.append(f"{url} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            broken.append(f"{url} (no such heading)")
    return broken


LINKED_FILES = [p for p in DOC_FILES if p.exists()] + sorted(NOTES.glob("*.md"))


@pytest.mark.parametrize("path", LINKED_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_heading(path):
    assert not broken_links(path), f"{path.relative_to(ROOT)}: broken links {broken_links(path)}"


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Title: one\n\n[ok](b.md#part-two) [self](#title-one)\n")
    (tmp_path / "b.md").write_text(
        "## Part two\n\n[gone](c.md) [bad](a.md#nope) [web](https://x)\n"
    )
    assert broken_links(tmp_path / "a.md") == []
    assert broken_links(tmp_path / "b.md") == ["c.md (no such file)", "a.md#nope (no such heading)"]


def test_the_notes_index_lists_each_dated_study_once():
    index = (NOTES / "README.md").read_text()
    studies = sorted(p.name for p in NOTES.glob("*.md") if p.name != "README.md")
    assert studies, "benchmarks/notes/ holds no study"
    for name in studies:
        assert re.fullmatch(r"\d{4}-\d\d-\d\d-[a-z0-9-]+\.md", name), f"{name}: YYYY-MM-DD-topic.md"
        assert index.count(f"]({name})") == 1, f"{name} must be linked once from the notes index"
        heading = (NOTES / name).read_text().splitlines()[0]
        assert heading.startswith("# ") and name[:10] in heading, f"{name}: heading {heading!r}"
