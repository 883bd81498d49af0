"""The README's op table is generated from the cast table and must not drift."""

import pathlib
import runpy

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_op_table_is_generated_from_the_cast_table():
    gen = runpy.run_path(str(ROOT / "tools" / "gen_op_table.py"))
    text = (ROOT / "README.md").read_text()
    assert gen["render"](text) == text, "README op table is stale: run python tools/gen_op_table.py"


def test_readme_gives_the_test_command_ci_runs():
    text = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in text and "python -m pytest -q" in ci
    assert "mixprec demo" in text
