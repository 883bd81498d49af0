"""Render `mixprec bench` JSON results as Markdown tables (for docs/benchmarks.md).

python tools/render_bench.py docs/bench/seed-mlp.json docs/bench/char-gpt.json
"""

from __future__ import annotations

import json
import sys

from mixprec.bench.report import markdown
from mixprec.bench.runner import ModeResult
from mixprec.bench.workloads import WORKLOADS


def render(path: str) -> str:
    with open(path) as f:
        doc = json.load(f)
    meta = doc["meta"]
    parts = [
        f"`{meta['command']}` — {meta['date']}, {meta['hardware']}, {meta['threads']} "
        f"threads, torch {meta['torch']}, Python {meta['python']}, {meta['dtype']}"
    ]
    for name, w in doc["workloads"].items():
        modes = {
            m: ModeResult(**{**r, "evals": [tuple(e) for e in r["evals"]]})
            for m, r in w["modes"].items()
        }
        parts.append(f"**{name}** ({w['metric']}, target {w['target']}): {w['description']}")
        parts.append(markdown(WORKLOADS[name], modes))
    return "\n\n".join(parts)


if __name__ == "__main__":
    print("\n\n".join(render(p) for p in sys.argv[1:]))
