"""Progress display for long runs: a rich progress bar, or plain lines without rich."""

from __future__ import annotations

from typing import Any

__all__ = ["make_progress"]


class _Plain:
    """Fallback progress reporting when ``rich`` is not installed."""

    def __enter__(self) -> _Plain:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def add(self, name: str, total: int) -> list[Any]:
        print(f"training {name} ({total} steps)...", flush=True)
        return [name, total, 0]

    def advance(self, task: list[Any]) -> None:
        task[2] += 1
        if task[2] % max(1, task[1] // 4) == 0:
            print(f"  {task[0]}: {task[2]}/{task[1]}", flush=True)


class _Rich:
    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self.progress = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )

    def __enter__(self) -> _Rich:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def add(self, name: str, total: int) -> Any:
        return self.progress.add_task(f"training {name}", total=total)

    def advance(self, task: Any) -> None:
        self.progress.advance(task)


def make_progress(enabled: bool = True) -> Any:
    """A progress display with ``add(name, total)`` and ``advance(task)``; silent if disabled."""
    if not enabled:
        quiet = _Plain()
        quiet.add = lambda name, total: [name, total, 0]  # type: ignore[method-assign]
        quiet.advance = lambda task: None  # type: ignore[method-assign]
        return quiet
    try:
        return _Rich()
    except ImportError:
        return _Plain()
