"""Where the Batch API's state lives: files' metadata, batches, and each input line's progress.

One schema and one set of statements for two databases: SQLite from the standard library (the default:
one router, a file in its batch directory) and PostgreSQL (``VLLM_STACK_BATCH_DATABASE_URL``: router
replicas share the work). Nothing is coordinated outside the database: a replica takes work by leasing rows
(``owner`` and ``lease_until``; in PostgreSQL the candidates are picked with ``FOR UPDATE SKIP LOCKED``, so
two replicas never take the same row and never wait for each other), keeps its leases alive while it works,
and anything whose lease ran out (its replica died) is taken again by any replica.

A line's life: ``waiting`` -> ``leased`` (sent to an engine; ``sends`` counts it) -> ``done`` with its
output or error line in ``result``. A line's result is written only by the replica that holds its lease
(the update is conditional on ``owner``), so a result is stored exactly once even when a line was re-sent
after its replica died; the batch's output and error files are written from these rows, one line each.

The methods are synchronous and run on the store's own thread (:meth:`BatchStore.run`): SQLite's and
psycopg's calls block, and one thread keeps one connection.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from vllm_stack.batch.objects import (
    ACTIVE,
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    FAILED,
    FINALIZING,
    IN_PROGRESS,
    VALIDATING,
)

T = TypeVar("T")
BLOCKING_CALL_SECONDS = 120.0  # a worker thread's call of the store (a page of results), at most

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS vs_files (
        id TEXT PRIMARY KEY,
        purpose TEXT NOT NULL,
        filename TEXT NOT NULL,
        bytes BIGINT NOT NULL,
        created_at BIGINT NOT NULL,
        seq BIGINT NOT NULL,
        tenant TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS vs_batches (
        id TEXT PRIMARY KEY,
        endpoint TEXT NOT NULL,
        model TEXT,
        input_file_id TEXT NOT NULL,
        completion_window TEXT NOT NULL,
        status TEXT NOT NULL,
        seq BIGINT NOT NULL,
        tenant TEXT NOT NULL,
        ending TEXT,
        created_at BIGINT NOT NULL,
        expires_at BIGINT NOT NULL,
        in_progress_at BIGINT,
        finalizing_at BIGINT,
        completed_at BIGINT,
        failed_at BIGINT,
        expired_at BIGINT,
        cancelling_at BIGINT,
        cancelled_at BIGINT,
        output_file_id TEXT,
        error_file_id TEXT,
        total INTEGER NOT NULL DEFAULT 0,
        completed INTEGER NOT NULL DEFAULT 0,
        failed INTEGER NOT NULL DEFAULT 0,
        metadata TEXT,
        errors TEXT,
        owner TEXT,
        lease_until DOUBLE PRECISION
    )""",
    "CREATE INDEX IF NOT EXISTS vs_batches_status ON vs_batches (status, seq)",
    "CREATE INDEX IF NOT EXISTS vs_batches_seq ON vs_batches (seq)",
    "CREATE INDEX IF NOT EXISTS vs_files_seq ON vs_files (seq)",
    """CREATE TABLE IF NOT EXISTS vs_lines (
        batch_id TEXT NOT NULL,
        idx INTEGER NOT NULL,
        custom_id TEXT NOT NULL,
        start BIGINT NOT NULL,
        length INTEGER NOT NULL,
        state TEXT NOT NULL,
        owner TEXT,
        lease_until DOUBLE PRECISION,
        not_before DOUBLE PRECISION NOT NULL DEFAULT 0,
        sends INTEGER NOT NULL DEFAULT 0,
        failed INTEGER NOT NULL DEFAULT 0,
        result TEXT,
        PRIMARY KEY (batch_id, idx)
    )""",
    "CREATE INDEX IF NOT EXISTS vs_lines_state ON vs_lines (batch_id, state, idx)",
    "CREATE INDEX IF NOT EXISTS vs_lines_leases ON vs_lines (state, lease_until)",
)

WAITING, LEASED, DONE = "waiting", "leased", "done"
BATCH_COLUMNS = (
    "id, endpoint, model, input_file_id, completion_window, status, ending, created_at, expires_at, "
    "in_progress_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at, cancelled_at, "
    "output_file_id, error_file_id, total, completed, failed, metadata, errors, owner, lease_until"
)
FILE_COLUMNS = "id, purpose, filename, bytes, created_at"
_ACTIVE_SQL = ", ".join(f"'{s}'" for s in ACTIVE)


class ClaimedLine:
    """A line this router leased to send: where it is in its batch's input file."""

    __slots__ = (
        "batch_id", "idx", "custom_id", "start", "length", "sends", "input_file_id", "endpoint", "settled"
    )  # fmt: skip

    def __init__(
        self,
        batch_id: str,
        idx: int,
        custom_id: str,
        start: int,
        length: int,
        sends: int,
        input_file_id: str,
        endpoint: str,
    ) -> None:
        self.batch_id = batch_id
        self.idx = idx
        self.custom_id = custom_id
        self.start = start
        self.length = length
        self.sends = sends  # including this one
        self.input_file_id = input_file_id
        self.endpoint = endpoint
        self.settled = False  # the runner recorded its result, or gave it back (sent again later)


class BatchStore:
    """The Batch API's tables in SQLite (``url`` None: ``directory/batch.sqlite3``) or PostgreSQL
    (``url`` ``postgresql://...``). ``owner`` names this router in the leases it takes."""

    def __init__(self, url: str | None, directory: Path, owner: str) -> None:
        self.postgres = bool(url)
        self.owner = owner
        self._url = url
        self._path = directory / "batch.sqlite3"
        self._conn: Any = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batch-store")

    # ---- the thread ------------------------------------------------------------------------------------------
    async def run(self, method: Callable[..., T], *args: Any) -> T:  # noqa: ANN401
        """Call one of the store's methods on its thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, method, *args)

    def call_blocking(self, method: Callable[..., T], *args: Any) -> T:  # noqa: ANN401
        """Call one of the store's methods on its thread from another worker thread (never the loop's);
        bounded, so a stuck store cannot hold a worker thread (and a stopping loop, which waits for its
        worker threads) for ever."""
        return self._thread.submit(method, *args).result(timeout=BLOCKING_CALL_SECONDS)

    def close(self) -> None:
        def shut() -> None:
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    self._conn.close()
                self._conn = None

        self._thread.submit(shut).result()
        self._thread.shutdown(wait=True)

    # ---- connection and statements ---------------------------------------------------------------------------
    def open(self) -> None:
        """Connect and create the tables (once, whoever comes first: PostgreSQL's creation is serialised
        by an advisory lock, since two replicas starting together would race on CREATE ... IF NOT EXISTS)."""
        self._connect()
        with self._transaction():
            if self.postgres:
                self._exec("SELECT pg_advisory_xact_lock(7263541)")
            for statement in SCHEMA:
                self._exec(statement)

    def _connect(self) -> None:
        if self.postgres:
            import psycopg  # lazy: only with a PostgreSQL URL

            self._conn = psycopg.connect(self._url, autocommit=True, connect_timeout=10)
        else:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False, timeout=30)
            conn.execute("PRAGMA journal_mode=WAL")  # durable when the process is killed; readers never wait
            conn.execute("PRAGMA synchronous=NORMAL")
            self._conn = conn

    def _sql(self, statement: str) -> str:
        return statement.replace("?", "%s") if self.postgres else statement

    def _exec(self, statement: str, params: Sequence[Any] = ()) -> Any:  # noqa: ANN401 - a DB-API cursor
        try:
            return self._conn.execute(self._sql(statement), params)
        except Exception as exc:
            if self.postgres and self._conn.closed:  # the server went away: one reconnect, then it raises
                self._connect()
            raise exc

    def _all(self, statement: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return list(self._exec(statement, params).fetchall())

    def _one(self, statement: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        return self._exec(statement, params).fetchone()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        if self._conn is None or (self.postgres and self._conn.closed):
            self._connect()
        if self.postgres:
            with self._conn.transaction():
                yield
            return
        self._conn.execute("BEGIN IMMEDIATE")  # one writer at a time, taken at the start
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def _skip_locked(self) -> str:
        return " FOR UPDATE SKIP LOCKED" if self.postgres else ""

    # ---- files ---------------------------------------------------------------------------------------------------
    def add_file(
        self, tenant: str, file_id: str, purpose: str, filename: str, size: int, created_at: int
    ) -> None:
        with self._transaction():
            self._exec(
                f"INSERT INTO vs_files ({FILE_COLUMNS}, seq, tenant) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (file_id, purpose, filename, size, created_at, time.time_ns(), tenant),
            )

    def get_file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        with self._transaction():
            row = self._one(
                f"SELECT {FILE_COLUMNS} FROM vs_files WHERE id = ? AND tenant = ?", (file_id, tenant)
            )
        return _file_row(row) if row else None

    def list_files(
        self, tenant: str, purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> list[dict]:
        """Files in creation order (newest first by default, as OpenAI lists them), after the one named."""
        clauses, params = ["tenant = ?"], [tenant]
        if purpose:
            clauses.append("purpose = ?")
            params.append(purpose)
        order = "DESC" if newest_first else "ASC"
        with self._transaction():
            if after:
                row = self._one("SELECT seq FROM vs_files WHERE id = ? AND tenant = ?", (after, tenant))
                if row is not None:
                    clauses.append(f"seq {'<' if newest_first else '>'} ?")
                    params.append(row[0])
            where = f"WHERE {' AND '.join(clauses)}"
            rows = self._all(
                f"SELECT {FILE_COLUMNS} FROM vs_files {where} ORDER BY seq {order} LIMIT ?",
                (*params, limit),
            )
        return [_file_row(r) for r in rows]

    def delete_file(self, tenant: str, file_id: str) -> str:
        """``deleted``, ``missing``, or ``in_use`` (a batch still running reads it)."""
        with self._transaction():
            if self._one("SELECT id FROM vs_files WHERE id = ? AND tenant = ?", (file_id, tenant)) is None:
                return "missing"
            busy = self._one(
                f"SELECT id FROM vs_batches WHERE input_file_id = ? AND status IN ({_ACTIVE_SQL}) LIMIT 1",
                (file_id,),
            )
            if busy is not None:
                return "in_use"
            self._exec("DELETE FROM vs_files WHERE id = ?", (file_id,))
        return "deleted"

    # ---- batches: the API's side ---------------------------------------------------------------------------------
    def add_batch(self, row: dict[str, Any]) -> None:
        row = {**row, "seq": time.time_ns()}  # the order batches are listed and run in
        names = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self._transaction():
            self._exec(f"INSERT INTO vs_batches ({names}) VALUES ({marks})", tuple(row.values()))

    def get_batch(self, tenant: str, batch_id: str) -> dict[str, Any] | None:
        with self._transaction():
            row = self._one(
                f"SELECT {BATCH_COLUMNS} FROM vs_batches WHERE id = ? AND tenant = ?", (batch_id, tenant)
            )
        return _batch_row(row) if row else None

    def list_batches(self, tenant: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        """Newest first (OpenAI's order), after the one named."""
        with self._transaction():
            where, params = "WHERE tenant = ?", [tenant]
            if after:
                row = self._one("SELECT seq FROM vs_batches WHERE id = ? AND tenant = ?", (after, tenant))
                if row is not None:
                    where, params = "WHERE tenant = ? AND seq < ?", [tenant, row[0]]
            rows = self._all(
                f"SELECT {BATCH_COLUMNS} FROM vs_batches {where} ORDER BY seq DESC LIMIT ?",
                (*params, limit),
            )
        return [_batch_row(r) for r in rows]

    def cancel_batch(self, tenant: str, batch_id: str, now: int) -> dict[str, Any] | None:
        """A validating or running batch becomes ``cancelling`` (any router then finalizes it as
        cancelled); one in any other state is returned unchanged."""
        with self._transaction():
            self._exec(
                "UPDATE vs_batches SET status = ?, ending = ?, cancelling_at = ?, owner = NULL, lease_until = NULL"
                " WHERE id = ? AND tenant = ? AND status IN (?, ?)",
                (CANCELLING, CANCELLED, now, batch_id, tenant, VALIDATING, IN_PROGRESS),
            )
            row = self._one(
                f"SELECT {BATCH_COLUMNS} FROM vs_batches WHERE id = ? AND tenant = ?", (batch_id, tenant)
            )
        return _batch_row(row) if row else None

    # ---- batches: the runner's side ------------------------------------------------------------------------------
    def claim_batch(self, status: str, now: float, lease: float) -> dict[str, Any] | None:
        """Lease the oldest batch in ``status`` that no live router holds (validation or finalization)."""
        with self._transaction():
            row = self._one(
                "SELECT id FROM vs_batches WHERE status = ? AND (lease_until IS NULL OR lease_until < ?)"
                f" ORDER BY seq LIMIT 1{self._skip_locked()}",
                (status, now),
            )
            if row is None:
                return None
            self._exec(
                "UPDATE vs_batches SET owner = ?, lease_until = ? WHERE id = ?",
                (self.owner, now + lease, row[0]),
            )
            full = self._one(f"SELECT {BATCH_COLUMNS} FROM vs_batches WHERE id = ?", (row[0],))
        return _batch_row(full) if full else None

    def release_batch(self, batch_id: str, retry_at: float) -> None:
        """Give up a batch this router holds (its validation or finalization failed): any router takes it
        again from ``retry_at``."""
        with self._transaction():
            self._exec(
                "UPDATE vs_batches SET owner = NULL, lease_until = ? WHERE id = ? AND owner = ?",
                (retry_at, batch_id, self.owner),
            )

    def start_batch(
        self, batch_id: str, model: str | None, lines: Sequence[tuple[int, str, int, int]], now: int
    ) -> bool:
        """A validated batch's lines, and the batch ``in_progress`` (False: it was cancelled meanwhile,
        or another router holds it now)."""
        with self._transaction():
            held = self._one(
                "SELECT id FROM vs_batches WHERE id = ? AND owner = ? AND status = ?",
                (batch_id, self.owner, VALIDATING),
            )
            if held is None:
                return False
            self._conn.cursor().executemany(
                self._sql(
                    "INSERT INTO vs_lines (batch_id, idx, custom_id, start, length, state) VALUES (?, ?, ?, ?, ?, ?)"
                ),
                [
                    (batch_id, idx, custom_id, start, length, WAITING)
                    for idx, custom_id, start, length in lines
                ],
            )
            self._exec(
                "UPDATE vs_batches SET status = ?, model = ?, total = ?, in_progress_at = ?, owner = NULL,"
                " lease_until = NULL WHERE id = ?",
                (IN_PROGRESS, model, len(lines), now, batch_id),
            )
        return True

    def fail_batch(self, batch_id: str, errors: str, now: int) -> None:
        """A batch whose input did not validate: ``failed``, with its errors (OpenAI's ``errors`` list)."""
        with self._transaction():
            self._exec(
                "UPDATE vs_batches SET status = ?, errors = ?, failed_at = ?, owner = NULL, lease_until = NULL"
                " WHERE id = ? AND owner = ? AND status = ?",
                (FAILED, errors, now, batch_id, self.owner, VALIDATING),
            )

    def expire_batches(self, now: float) -> int:
        """Batches past their completion window stop: unsent lines go to the error file as expired."""
        with self._transaction():
            cursor = self._exec(
                "UPDATE vs_batches SET status = ?, ending = ?, finalizing_at = ?, owner = NULL, lease_until = NULL"
                " WHERE status IN (?, ?) AND expires_at <= ?",
                (FINALIZING, EXPIRED, int(now), VALIDATING, IN_PROGRESS, now),
            )
            return cursor.rowcount

    def finish_ready_batches(self, now: float) -> int:
        """Running batches with every line done (a router died between a last line and the batch's turn to
        ``finalizing``): their turn now."""
        with self._transaction():
            cursor = self._exec(
                "UPDATE vs_batches SET status = ?, ending = ?, finalizing_at = ? WHERE status = ? AND NOT EXISTS"
                " (SELECT 1 FROM vs_lines WHERE vs_lines.batch_id = vs_batches.id AND vs_lines.state <> ?)",
                (FINALIZING, COMPLETED, int(now), IN_PROGRESS, DONE),
            )
            return cursor.rowcount

    def claim_lines(self, limit: int, now: float, lease: float, max_sends: int) -> list[ClaimedLine]:
        """Lease up to ``limit`` lines to send: those whose lease ran out first (their router died; each is
        re-sent once per such death, up to ``max_sends`` sends in all, then failed), then waiting ones of the
        running batches, oldest batch first."""
        claimed: list[ClaimedLine] = []
        with self._transaction():
            stale = self._all(
                f"SELECT batch_id, idx FROM vs_lines WHERE state = ? AND lease_until < ? LIMIT ?{self._skip_locked()}",
                (LEASED, now, limit),
            )
            for batch_id, idx in stale:
                self._exec(
                    "UPDATE vs_lines SET state = ?, owner = NULL, lease_until = NULL WHERE batch_id = ? AND idx = ?",
                    (WAITING, batch_id, idx),
                )
            batches = self._all(
                "SELECT id, input_file_id, endpoint FROM vs_batches WHERE status = ? ORDER BY seq",
                (IN_PROGRESS,),
            )
            for batch_id, input_file_id, endpoint in batches:
                if len(claimed) >= limit:
                    break
                rows = self._all(
                    "SELECT idx FROM vs_lines WHERE batch_id = ? AND state = ? AND not_before <= ?"
                    f" ORDER BY idx LIMIT ?{self._skip_locked()}",
                    (batch_id, WAITING, now, limit - len(claimed)),
                )
                for (idx,) in rows:
                    row = self._one(
                        "UPDATE vs_lines SET state = ?, owner = ?, lease_until = ?, sends = sends + 1"
                        " WHERE batch_id = ? AND idx = ? RETURNING custom_id, start, length, sends",
                        (LEASED, self.owner, now + lease, batch_id, idx),
                    )
                    assert row is not None
                    claimed.append(
                        ClaimedLine(batch_id, idx, row[0], row[1], row[2], row[3], input_file_id, endpoint)
                    )
        return [c for c in claimed if c.sends <= max_sends] + self._give_up(
            [c for c in claimed if c.sends > max_sends]
        )

    def _give_up(self, lines: list[ClaimedLine]) -> list[ClaimedLine]:
        """Lines sent ``max_sends`` times already (each time their router died): the caller fails them."""
        for line in lines:
            line.sends = -line.sends  # marks it for the runner: record a failure, do not send
        return lines

    def renew_leases(
        self, lines: Sequence[tuple[str, int]], batches: Sequence[str], now: float, lease: float
    ) -> None:
        """The leases of the ``lines`` (batch id, index) and ``batches`` this router works on run on; any
        other lease it holds runs out."""
        with self._transaction():
            for batch_id, idx in lines:
                self._exec(
                    "UPDATE vs_lines SET lease_until = ? WHERE batch_id = ? AND idx = ? AND owner = ? AND state = ?",
                    (now + lease, batch_id, idx, self.owner, LEASED),
                )
            for batch_id in batches:
                self._exec(
                    "UPDATE vs_batches SET lease_until = ? WHERE id = ? AND owner = ? AND status IN (?, ?, ?)",
                    (now + lease, batch_id, self.owner, VALIDATING, FINALIZING, CANCELLING),
                )

    def release_line(self, batch_id: str, idx: int, not_before: float, unsent: bool) -> None:
        """A line waiting again, to be sent no earlier than ``not_before``: the director shed it (the
        engines are busy with interactive work; ``unsent``: the send it was leased for does not count), or
        its engine failed."""
        with self._transaction():
            self._exec(
                "UPDATE vs_lines SET state = ?, owner = NULL, lease_until = NULL, not_before = ?, sends = sends - ?"
                " WHERE batch_id = ? AND idx = ? AND state = ? AND owner = ?",
                (WAITING, not_before, int(unsent), batch_id, idx, LEASED, self.owner),
            )

    def finish_line(self, batch_id: str, idx: int, failed: bool, result: bytes, now: float) -> bool:
        """Store a line's output or error line, when this router still holds its lease (False: it does
        not, and the result is dropped: the line was taken again, or its batch ended). The batch's counts
        move with it, and the last line turns the batch to ``finalizing``."""
        with self._transaction():
            cursor = self._exec(
                "UPDATE vs_lines SET state = ?, owner = NULL, lease_until = NULL, failed = ?, result = ?"
                " WHERE batch_id = ? AND idx = ? AND state = ? AND owner = ?",
                (DONE, int(failed), result.decode(), batch_id, idx, LEASED, self.owner),
            )
            if cursor.rowcount != 1:
                return False
            # the counts' update locks the batch's row: the last two lines' checks below cannot both miss
            self._exec(
                "UPDATE vs_batches SET completed = completed + ?, failed = failed + ? WHERE id = ?",
                (0 if failed else 1, 1 if failed else 0, batch_id),
            )
            left = self._one(
                "SELECT 1 FROM vs_lines WHERE batch_id = ? AND state <> ? LIMIT 1", (batch_id, DONE)
            )
            if left is None:
                self._exec(
                    "UPDATE vs_batches SET status = ?, ending = ?, finalizing_at = ? WHERE id = ? AND status = ?",
                    (FINALIZING, COMPLETED, int(now), batch_id, IN_PROGRESS),
                )
        return True

    def close_lines(self, batch_id: str) -> None:
        """Finalization begins: no line of the batch may be sent or finish any more (an unsent one is
        written to the error file as expired or cancelled)."""
        with self._transaction():
            self._exec(
                "UPDATE vs_lines SET state = ?, owner = NULL, lease_until = NULL WHERE batch_id = ? AND state <> ?",
                (DONE, batch_id, DONE),
            )

    def results(self, batch_id: str, after: int, limit: int) -> list[tuple[int, str, int, str | None]]:
        """Lines ``idx > after`` in order: (idx, custom_id, failed, result; None: never answered)."""
        with self._transaction():
            return self._all(
                "SELECT idx, custom_id, failed, result FROM vs_lines WHERE batch_id = ? AND idx > ?"
                " ORDER BY idx LIMIT ?",
                (batch_id, after, limit),
            )

    def end_batch(
        self,
        batch_id: str,
        ending: str,
        files: Sequence[tuple[str, str, int]],
        counts: tuple[int, int],
        now: int,
    ) -> bool:
        """The batch's files are written: their rows, and the batch in its final status, together."""
        stamp = {COMPLETED: "completed_at", EXPIRED: "expired_at", CANCELLED: "cancelled_at"}[ending]
        output = next((f for f in files if f[0].endswith("-output")), None)
        errors = next((f for f in files if f[0].endswith("-error")), None)
        with self._transaction():
            held = self._one(
                "SELECT tenant FROM vs_batches WHERE id = ? AND owner = ? AND status IN (?, ?)",
                (batch_id, self.owner, FINALIZING, CANCELLING),
            )
            if held is None:
                return False
            for file_id, filename, size in files:  # the batch's owner's files
                self._exec("DELETE FROM vs_files WHERE id = ?", (file_id,))
                self._exec(
                    f"INSERT INTO vs_files ({FILE_COLUMNS}, seq, tenant) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (file_id, "batch_output", filename, size, now, time.time_ns(), held[0]),
                )
            self._exec(
                f"UPDATE vs_batches SET status = ?, {stamp} = ?, output_file_id = ?, error_file_id = ?,"
                " completed = ?, failed = ?, owner = NULL, lease_until = NULL WHERE id = ?",
                (ending, now, output and output[0], errors and errors[0], counts[0], counts[1], batch_id),
            )
        return True

    # ---- figures for the metrics ------------------------------------------------------------------------------
    def figures(self) -> tuple[dict[str, int], int]:
        """Batches by status, and lines waiting to be sent."""
        with self._transaction():
            statuses = {
                status: count
                for status, count in self._all("SELECT status, COUNT(*) FROM vs_batches GROUP BY status")
            }
            waiting = self._one(
                "SELECT COUNT(*) FROM vs_lines JOIN vs_batches ON vs_batches.id = vs_lines.batch_id"
                " WHERE vs_lines.state = ? AND vs_batches.status = ?",
                (WAITING, IN_PROGRESS),
            )
        return statuses, int(waiting[0]) if waiting else 0


def _file_row(row: tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(("id", "purpose", "filename", "bytes", "created_at"), row, strict=True))


_BATCH_NAMES = tuple(name.strip() for name in BATCH_COLUMNS.split(","))


def _batch_row(row: tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(_BATCH_NAMES, row, strict=True))


def now_seconds() -> int:
    return int(time.time())
