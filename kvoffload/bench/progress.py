"""The progress bar of ``kvoffload bench`` on stderr: rich when installed (the bench extra),
otherwise one line per finished step."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any


class Progress:
    """``total`` steps; ``note`` shows a step's latest output line, ``advance`` ends a step."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.label = ""
        self.started = time.monotonic()
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import Progress as RichProgress
        except ImportError:
            return self
        self._bar = RichProgress(
            SpinnerColumn(),
            TextColumn("{task.description}", style="bold"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[line]}", style="dim"),
            console=Console(stderr=True),
            transient=False,
        )
        self._bar.__enter__()
        self._task = self._bar.add_task("kvoffload bench", total=self.total, line="")
        return self

    def note(self, label: str, line: str) -> None:
        self.label = label
        if self._bar is not None:
            self._bar.update(self._task, description=label, line=line[:60])

    def advance(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.advance(self._task)
        else:
            elapsed = time.monotonic() - self.started
            print(
                f"[{self.done}/{self.total}] {self.label} done ({elapsed:.0f} s)", file=sys.stderr
            )

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description="kvoffload bench", line="")
            self._bar.__exit__(kind, exc, tb)
