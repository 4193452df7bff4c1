"""The cluster tier's cases run a few at a time, each reported by its own test.

One case (a values file with one Helm) spends most of its time waiting: for the API server, for the
scheduler and kwok to make Pods Ready, for Helm. Run one after another, the ~150 cases of this tier take
longer than its 10-minute budget; so the first test of a module that asks for a result starts every case
of that module on a small thread pool, and each test then waits for its own case and re-raises what it
raised. Cases that claim the same fixed nodePort (cluster-wide) never run at the same time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

#: Concurrent cases: enough to keep the API server busy on two cores while others wait on Pods.
WORKERS = 4


class ConcurrentCases:
    """Runs ``run(case)`` for every case on first demand; ``result(case)`` waits for one and re-raises."""

    def __init__(
        self, run: Callable[[Hashable], None], cases: Iterable[Hashable], workers: int = WORKERS
    ) -> None:
        self._run = run
        self._cases = list(cases)
        self._workers = workers
        self._futures: dict[Hashable, Future[None]] = {}
        self._started = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def result(self, case: Hashable) -> None:
        with self._started:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="cluster-case")
                self._futures = {c: self._pool.submit(self._run, c) for c in self._cases}
        self._futures[case].result()

    def close(self) -> None:
        """Cancel what has not started, wait for what has (a test session ending early)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


class KeyedLocks:
    """One lock per key (a nodePort), taken in a fixed order so that two cases never deadlock."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[int, threading.Lock] = {}

    def holding(self, keys: Iterable[int]) -> _Held:
        with self._guard:
            locks = [self._locks.setdefault(key, threading.Lock()) for key in sorted(set(keys))]
        return _Held(locks)


class _Held:
    def __init__(self, locks: list[threading.Lock]) -> None:
        self._locks = locks

    def __enter__(self) -> None:
        for lock in self._locks:
            lock.acquire()

    def __exit__(self, *exc: object) -> None:
        for lock in reversed(self._locks):
            lock.release()


def helm_matrix(files: Iterable[Path], ids: Callable[[Path], str]) -> list[object]:
    """Each values file with Helm 3 and Helm 4: in `make test`, one of the two per file (alternating, so
    both majors run on half the files each); the other with marker ``cluster_full`` (`make test-cluster`
    runs the whole matrix)."""
    cases = []
    for index, values in enumerate(files):
        for major in (3, 4):
            marks = [] if major == (3, 4)[index % 2] else [pytest.mark.cluster_full]
            cases.append(pytest.param(values, major, marks=marks, id=f"{ids(values)}-helm{major}"))
    return cases


def selected(request: pytest.FixtureRequest, test: str, names: Sequence[str]) -> list[tuple[object, ...]]:
    """The cases of ``test`` this session runs, in order: a deselected case (``cluster_full``'s, or one
    left out by ``-k``) is not started by its module's :class:`ConcurrentCases`."""
    return [
        tuple(item.callspec.params[name] for name in names)  # type: ignore[attr-defined]
        for item in request.session.items
        if getattr(item, "originalname", None) == test
    ]
