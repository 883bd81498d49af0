"""``pytest`` and ``python -m pytest`` collect the same suite.

``python -m pytest`` puts the working directory on ``sys.path``; the bare ``pytest`` script does
not, so a test module that imports a shared helper as ``tests.<module>`` collects under one and
fails under the other unless the configuration puts the repository root on the path.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# modules that import helpers as ``tests.<module>``: the ones a bare ``pytest`` once missed
HELPER_USERS = sorted(
    str(p.relative_to(ROOT))
    for p in (ROOT / "tests").rglob("test_*.py")
    if "from tests." in p.read_text() or "import tests." in p.read_text()
)


def _collected(bare: bool) -> list[str]:
    # -I: isolated, as the console script runs: neither the working directory nor PYTHONPATH
    # on sys.path
    head = [sys.executable, "-I", "-c", "import sys, pytest; sys.exit(pytest.console_main())"]
    cmd = [*(head if bare else [sys.executable, "-m", "pytest"]), "--co", "-q", *HELPER_USERS]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_bare_pytest_collects_what_python_m_pytest_collects():
    assert len(HELPER_USERS) >= 6, HELPER_USERS
    with_module = _collected(bare=False)
    assert with_module, "python -m pytest collected nothing"
    assert _collected(bare=True) == with_module
