"""Refresh the line counts of docs/design.md's package layout block from the tree.

python tools/refresh_layout.py
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lines(path: Path) -> int:
    files = path.rglob("*.py") if path.is_dir() else [path]
    return sum(f.read_text().count("\n") for f in files)


def refresh(line: str) -> str:
    m = re.match(r"^(\s*)(\S.*?)(\s{2,})(\S.*)$", line)
    if m is None:
        return line
    lead, entries, gap, text = m.groups()
    # entries at 4 spaces are in _core/, at 6 in _core/update/ (the block's nesting)
    base = ROOT / "mixprec" / {4: "_core", 6: "_core/update"}.get(len(lead), "")

    def count(e: re.Match[str]) -> str:
        path = base / e.group(1).rstrip("/")
        return f"{e.group(1)} {lines(path):,}" if path.exists() else e.group(0)

    new = lead + re.sub(r"([\w.]+/?) (\d+(?:,\d{3})*)", count, entries)
    column = len(lead) + len(entries) + len(gap)
    return new.ljust(max(column, len(new) + 1)) + text


def main() -> None:
    doc = ROOT / "docs" / "design.md"
    text = doc.read_text()
    start = text.index("```text\nmixprec/")
    end = text.index("```", start + 8)
    block = "\n".join(refresh(x) for x in text[start:end].split("\n"))
    doc.write_text(text[:start] + block + text[end:])


if __name__ == "__main__":
    main()
