"""The Batch API's tests: a real PostgreSQL server (vllm_stack_dev.testbed.postgres), started once per
session on loopback and stopped at its end; each test that asks for ``postgres_dsn`` gets a fresh database.

The server starts in well under a second here (initdb included), so these tests are in the fast tier
(`make test-fast`); they are marked ``postgres``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm_stack_dev.testbed.postgres import PostgresError, PostgresServer, find_binaries


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    try:
        find_binaries()
    except PostgresError as error:
        pytest.fail(str(error), pytrace=False)
    with PostgresServer(tmp_path_factory.mktemp("postgres")) as server:
        yield server


@pytest.fixture
def postgres_dsn(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> str:
    """The DSN of a new, empty database named after the test."""
    return postgres_server.new_database(request.node.name)
