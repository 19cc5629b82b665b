"""Run the items of one job on the calling thread and on helper threads at once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")


def fan_out(
    count: int, run: Callable[[int], T], helpers: ThreadPoolExecutor, max_helpers: int
) -> Generator[T, None, None]:
    """Call ``run(i)`` for every ``i`` in ``range(count)`` and yield the results in index order,
    each as soon as it and every result before it are ready.

    The calling thread takes items itself whenever the next result is not ready yet, and up to
    ``max_helpers`` tasks on ``helpers`` (shared with other jobs) take items from the same
    list, so a job never waits for a free helper to make progress. An exception of ``run(i)``
    is raised in its turn; no new item starts after that or after the generator is closed, and
    every item started has returned before the generator ends, raises or is closed."""
    results: list[T | None] = [None] * count
    errors: list[BaseException | None] = [None] * count
    finished = [False] * count
    cv = threading.Condition()
    state = {"next": 0, "stopped": False, "waiting_for": -1}

    def take() -> int | None:
        with cv:
            index = state["next"]
            if state["stopped"] or index >= count:
                return None
            state["next"] = index + 1
            return index

    def work(index: int) -> None:
        try:
            results[index] = run(index)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors[index] = exc
        with cv:
            finished[index] = True
            if state["waiting_for"] == index:
                cv.notify()

    def drain() -> None:
        while (index := take()) is not None:
            work(index)

    futures = [helpers.submit(drain) for _ in range(min(max_helpers, count - 1))]
    try:
        for index in range(count):
            while not finished[index]:
                mine = take()
                if mine is not None:
                    work(mine)
                    continue
                with cv:
                    state["waiting_for"] = index
                    while not finished[index]:
                        cv.wait()
                    state["waiting_for"] = -1
            error = errors[index]
            if error is not None:
                raise error
            result = results[index]
            results[index] = None
            yield result  # type: ignore[misc]
    finally:
        with cv:
            state["stopped"] = True
        wait(futures)
