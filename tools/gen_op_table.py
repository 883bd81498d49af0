"""Regenerate the op table in docs/ops.md from the cast table (the one source of truth).

python tools/gen_op_table.py          # rewrite docs/ops.md in place
python tools/gen_op_table.py --check  # exit 1 if docs/ops.md is out of date
"""

from __future__ import annotations

import pathlib
import sys

from mixprec.core.cast_table import table_markdown

BEGIN, END = "<!-- op-table:begin -->", "<!-- op-table:end -->"
TARGET = pathlib.Path(__file__).resolve().parent.parent / "docs" / "ops.md"


def render(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise ValueError(
            f"{TARGET} has no {BEGIN} ... {END} markers; put them where the table goes"
        )
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table_markdown()}\n{END}{tail}"


if __name__ == "__main__":
    text = TARGET.read_text()
    new = render(text)
    if "--check" in sys.argv:
        if new != text:
            print(f"{TARGET} is out of date: run python tools/gen_op_table.py", file=sys.stderr)
        sys.exit(0 if new == text else 1)
    TARGET.write_text(new)
