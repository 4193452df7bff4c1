"""Fixtures for router tests that use stub engines (fast, no real vLLM)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import running_router, stubs


@pytest.fixture
async def two_stubs() -> AsyncIterator[tuple[list[StubEngine], list[str]]]:
    engines = [StubEngine("s1", ["stub-model"]), StubEngine("s2", ["stub-model"])]
    async with stubs(*engines) as urls:
        yield engines, urls


@pytest.fixture
async def router2(two_stubs):  # noqa: ANN001, ANN201 - (url, router, engines)
    engines, urls = two_stubs
    async with running_router(urls) as (url, router):
        yield url, router, engines
