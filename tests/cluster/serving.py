"""What the cluster tests that serve requests share: waiting on a condition, load through the router, and
what reached an engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from vllm_stack_dev.testbed.engines import Engine, metric_sum

from tests.conftest import CHAT_MODEL


def wait_for(
    condition: Callable[[], Any], timeout: float, what: str | Callable[[], str], interval: float = 0.05
) -> Any:
    """``condition()``'s first truthy value; AssertionError naming ``what`` after ``timeout`` (a callable
    ``what`` is called then, so the message can carry what is known only at the failure: a log's tail)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what() if callable(what) else what}")
        time.sleep(interval)


class Load:
    """Completions sent through the router from ``threads`` threads until stopped; every answer recorded
    (0: no answer at all)."""

    def __init__(self, url: str, threads: int = 2, max_tokens: int = 2) -> None:
        self._stop = threading.Event()
        self.codes: list[int] = []
        self.max_tokens = max_tokens
        self._threads = [
            threading.Thread(target=self._run, args=(url, i), daemon=True) for i in range(threads)
        ]

    def _run(self, url: str, index: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                body = {"model": CHAT_MODEL, "prompt": f"load {index} {n}", "max_tokens": self.max_tokens}
                try:
                    self.codes.append(client.post("/v1/completions", json=body).status_code)
                except httpx.HTTPError:
                    self.codes.append(0)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


def requests_in(engine: Engine) -> tuple[float, float]:
    """(finished, still in the engine: running or waiting), from one scrape of the engine's /metrics."""
    metrics = engine.metrics()
    inside = metric_sum(metrics, "vllm:num_requests_running") + metric_sum(
        metrics, "vllm:num_requests_waiting"
    )
    return metric_sum(metrics, "vllm:request_success_total"), inside


def arrivals(engine: Engine) -> float:
    """Requests that reached the engine so far (finished, running or waiting), for "it got some": the
    gauges and the counter are not updated together, so a request may be counted twice for an instant."""
    return sum(requests_in(engine))
