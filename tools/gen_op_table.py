"""Regenerate the README's op table from the cast table (the one source of truth).

python tools/gen_op_table.py          # rewrite README.md in place
python tools/gen_op_table.py --check  # exit 1 if README.md is out of date
"""

from __future__ import annotations

import pathlib
import sys

from mixprec.core.cast_table import table_markdown

BEGIN, END = "<!-- op-table:begin -->", "<!-- op-table:end -->"
README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def render(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table_markdown()}\n{END}{tail}"


if __name__ == "__main__":
    text = README.read_text()
    new = render(text)
    if "--check" in sys.argv:
        sys.exit(0 if new == text else 1)
    README.write_text(new)
