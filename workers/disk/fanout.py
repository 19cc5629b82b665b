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
    results: dict[int, T] = {}
    errors: list[BaseException | None] = [None] * count
    done = [threading.Event() for _ in range(count)]
    lock = threading.Lock()
    pending = iter(range(count))
    stopped = False

    def take() -> int | None:
        with lock:
            return None if stopped else next(pending, None)

    def work(index: int) -> None:
        try:
            results[index] = run(index)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors[index] = exc
        finally:
            done[index].set()

    def drain() -> None:
        while (index := take()) is not None:
            work(index)

    futures = [helpers.submit(drain) for _ in range(min(max_helpers, count - 1))]
    try:
        for index in range(count):
            while not done[index].is_set():
                mine = take()
                if mine is None:
                    done[index].wait()
                else:
                    work(mine)
            error = errors[index]
            if error is not None:
                raise error
            yield results.pop(index)
    finally:
        with lock:
            stopped = True
        wait(futures)
