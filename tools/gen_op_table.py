"""Regenerate the op table in docs/ops.md from the cast table (the one source of truth).

python tools/gen_op_table.py          # rewrite docs/ops.md in place
python tools/gen_op_table.py --check  # exit 1 if docs/ops.md is out of date

Two marks come from data too: the engine's ``FP32_INSIDE_OPS`` (16-bit in and out at O2/O3)
and the table's ``PYTHON_FUNCTIONS`` (entries the eager engine never sees whole).
"""

from __future__ import annotations

import pathlib
import sys

from mixprec._core._autocast_rules import FP32_INSIDE_OPS
from mixprec._core.cast_table import DEFAULT_TABLE, FP32, PYTHON_FUNCTIONS, table_markdown

BEGIN, END = "<!-- op-table:begin -->", "<!-- op-table:end -->"
TARGET = pathlib.Path(__file__).resolve().parent.parent / "docs" / "ops.md"
INSIDE, PYTHON = "†", "‡"
LEGEND = (
    f"{INSIDE} at O2 and O3 (`fp32_inside`): 16-bit inputs, weights included, and a 16-bit "
    "output; the kernel computes in float32 inside.\n\n"
    f"{PYTHON} a Python function, not an aten op: in eager mode each op it calls follows its "
    "own rule ([below](#python-functions-in-the-table))."
)


def marks() -> dict[str, str]:
    out = {n: INSIDE for n in FP32_INSIDE_OPS if DEFAULT_TABLE.get(n) == FP32}
    for name in PYTHON_FUNCTIONS:
        out[name] = out.get(name, "") + PYTHON
    return out


def render(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise ValueError(
            f"{TARGET} has no {BEGIN} ... {END} markers; put them where the table goes"
        )
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table_markdown(marks=marks())}\n\n{LEGEND}\n{END}{tail}"


if __name__ == "__main__":
    text = TARGET.read_text()
    new = render(text)
    if "--check" in sys.argv:
        if new != text:
            print(f"{TARGET} is out of date: run python tools/gen_op_table.py", file=sys.stderr)
        sys.exit(0 if new == text else 1)
    TARGET.write_text(new)
