"""The test bed's PostgreSQL server: the real server, password authentication on loopback, a database per
test, and the row leases the Batch API's shared store relies on (``FOR UPDATE SKIP LOCKED``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import psycopg
import pytest
from vllm_stack_dev.testbed.postgres import PostgresServer, find_binaries

pytestmark = pytest.mark.postgres


def test_real_server_with_password_on_loopback(postgres_server: PostgresServer, postgres_dsn: str) -> None:
    with psycopg.connect(postgres_dsn, connect_timeout=10) as conn:
        version = conn.execute("SELECT version()").fetchone()[0]
        address = conn.execute("SELECT inet_server_addr()::text").fetchone()[0]
    match = re.match(r"PostgreSQL (\d+)", version)
    assert match, version
    # The binaries the test bed picked: Debian 12's postgresql-15 here.
    assert match.group(1) == find_binaries().parent.name
    assert int(match.group(1)) >= 15
    assert address == "127.0.0.1/32"
    assert f":{postgres_server.password}@127.0.0.1:" in postgres_dsn
    wrong = postgres_dsn.replace(postgres_server.password, "not-the-password")
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(wrong, connect_timeout=10).close()


def test_each_test_gets_a_fresh_database(postgres_server: PostgresServer, postgres_dsn: str) -> None:
    other = postgres_server.new_database("other")
    assert other != postgres_dsn
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE mine (id int)")
    with psycopg.connect(other) as conn:
        tables = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()[0]
    assert tables == 0


def test_skip_locked_claims_disjoint_rows(postgres_dsn: str) -> None:
    """Two replicas claim work at once: each locks rows the other skips, and a third finds none left;
    what a transaction releases (a replica that rolled back or died) is claimable again."""
    claim = "SELECT id FROM jobs WHERE state = 'queued' ORDER BY id LIMIT 3 FOR UPDATE SKIP LOCKED"
    with psycopg.connect(postgres_dsn, autocommit=True) as setup:
        setup.execute("CREATE TABLE jobs (id int PRIMARY KEY, state text NOT NULL)")
        setup.execute("INSERT INTO jobs SELECT i, 'queued' FROM generate_series(1, 6) AS i")
    a = psycopg.connect(postgres_dsn, connect_timeout=10)
    b = psycopg.connect(postgres_dsn, connect_timeout=10)
    c = psycopg.connect(postgres_dsn, connect_timeout=10)
    try:
        # psycopg opens a transaction at the first statement (autocommit off): the locks last until commit.
        claimed_a = [row[0] for row in a.execute(claim)]
        claimed_b = [row[0] for row in b.execute(claim)]
        assert claimed_a == [1, 2, 3]
        assert claimed_b == [4, 5, 6]
        assert list(c.execute(claim)) == []  # everything is leased
        with pytest.raises(psycopg.errors.LockNotAvailable):  # ...and really locked
            c.execute("SELECT id FROM jobs WHERE id = 1 FOR UPDATE NOWAIT")
        c.rollback()

        a.execute("UPDATE jobs SET state = 'running' WHERE id = ANY(%s)", (claimed_a,))
        a.commit()
        b.rollback()  # b's leases end: its rows are queued and unlocked again
        assert [row[0] for row in c.execute(claim)] == [4, 5, 6]
        c.commit()
        states = dict(c.execute("SELECT id, state FROM jobs ORDER BY id").fetchall())
        assert states == {1: "running", 2: "running", 3: "running", 4: "queued", 5: "queued", 6: "queued"}
    finally:
        for conn in (a, b, c):
            conn.close()


def test_stop_ends_the_server_despite_an_open_transaction(tmp_path: Path) -> None:
    """A connection left open (a test that failed half-way) does not hold the stop: fast shutdown."""
    with PostgresServer(tmp_path) as server:
        postmaster = server.process.pid
        root = server.root
        leaked = psycopg.connect(server.dsn, connect_timeout=10)
        leaked.execute("SELECT 1")  # a transaction stays open
    assert server.process is None
    with pytest.raises(ProcessLookupError):
        os.kill(postmaster, 0)
    if os.geteuid() == 0 and not str(root).startswith(str(tmp_path)):
        assert not root.exists()  # the private folder outside tmp_path is removed
    leaked.close()
