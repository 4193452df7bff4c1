"""Runs batches: validates new ones, sends their lines through the director, writes their output and error
files, expires and cancels them. Every router with the Batch API on runs one; with a shared PostgreSQL
store the replicas share the work, each taking what it leases (:mod:`.store`).

Lines go at sheddable priority (or lower, when their model's default is lower), at most ``concurrency`` of
this router's at once, and only to engines with a running slot free beyond ``reserve_slots``
(:func:`vllm_stack.engines.load.background_room`): a line holds its slot until it ends, and vLLM does not
preempt it for an interactive request, so the slots interactive requests arrive into stay free. While no
engine of its model has room, a line waits (its ``not_before``); while interactive requests keep every engine
saturated, the director sheds one at once (429) instead of queueing it. Either way the runner backs off,
doubling up to :data:`MAX_BACKOFF`, and the line is sent again. A line whose engine failed (502, 503, 504, or no
answer) is sent again up to ``max_sends`` times in all; any other answer is the line's result: a 200 goes to
the output file, anything else to the error file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import orjson

from vllm_stack.api.proxied import model_served, provider_body, resolve
from vllm_stack.api.state import RouterState
from vllm_stack.batch.files import FileDirectory
from vllm_stack.batch.line_request import BatchLineRequest, send_failed
from vllm_stack.batch.objects import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    FINALIZING,
    STATUSES,
    VALIDATING,
    output_file_id,
    result_line,
    unsent_line,
)
from vllm_stack.batch.store import BatchStore, ClaimedLine
from vllm_stack.batch.validation import CheckedInput, check_input, check_models
from vllm_stack.engines.engine import Engine
from vllm_stack.engines.load import background_room
from vllm_stack.errors import RouterError, error_body
from vllm_stack.metrics import RouterMetrics
from vllm_stack.request_id import new_request_id

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5  # how often an idle runner looks for work (other replicas' batches, expired leases)
SWEEP_SECONDS = 1.0  # expiry, batches whose last line was done by a router that then died
FIGURES_SECONDS = 2.0  # the metrics' figures read from the store
MAX_BACKOFF = 5.0  # seconds, at most, between two tries while the director sheds batch lines
RETRY_STATUSES = frozenset({502, 503, 504})  # an engine's failure: the line is sent again
SHED_STATUSES = frozenset({429, 503})  # the director's refusal: busy engines, or none ready yet
RESULT_PAGE = 1000  # lines read from the store at a time while writing a batch's files
RETRY_BATCH_SECONDS = 5.0  # a validation or finalization that failed is tried again after this
STOP_JOBS_SECONDS = 10.0  # a stopping router waits this long, at most, for its store writes and jobs
MISSING_INPUT = (
    "The input file's contents are missing from the router's batch directory (with router replicas, the "
    "batch directory must be one volume every replica mounts: ReadWriteMany)."
)


class _Line(msgspec.Struct):
    """What the runner reads of an input line: its body, as raw JSON (sent as it is, never re-encoded)."""

    body: msgspec.Raw


_LINE = msgspec.json.Decoder(_Line)

UNSENT = {
    EXPIRED: ("batch_expired", "This request could not be executed before the completion window expired."),
    CANCELLED: ("batch_cancelled", "This request was not executed: the batch was cancelled."),
}


@dataclass(frozen=True, slots=True)
class BatchSettings:
    directory: Path
    database_url: str | None
    completion_window: float  # seconds of OpenAI's "24h"
    max_file_bytes: int
    concurrency: int  # lines in flight from this router
    lease_seconds: float
    reserve_slots: int = 2  # running slots per engine batch lines leave free (for interactive requests)
    max_kv_cache_usage: float = 0.8  # an engine past this KV cache usage takes no batch line
    max_sends: int = 3  # sends of one line in all (engine failures, routers that died holding it)


class BatchRunner:
    """One router's share of the batch work."""

    def __init__(self, router: RouterState, settings: BatchSettings, metrics: RouterMetrics) -> None:
        self.router = router
        self.settings = settings
        self.metrics = metrics
        self.files = FileDirectory(settings.directory)
        owner = f"{os.uname().nodename}-{os.getpid()}-{os.urandom(4).hex()}"
        self.store = BatchStore(settings.database_url, settings.directory, owner)
        self.session: aiohttp.ClientSession = None  # type: ignore[assignment] - made at start
        self.in_flight: dict[tuple[str, int], BatchLineRequest] = {}
        self._preparing: set[tuple[str, int]] = set()  # lines leased whose body is being read (off the loop)
        self._reading = asyncio.Semaphore(1)  # one line read at a time: a line and its body's copy, at most
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._jobs: set[asyncio.Task[Any]] = (
            set()
        )  # store writes of ended lines, a validation, a finalization
        self._busy: set[str] = set()  # batches this router validates or finalizes now
        self._backoff = 0.0
        self._paused_until = 0.0
        self._next_sweep = 0.0

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self, engine_tls: Any = None) -> None:  # noqa: ANN401 - an ssl.SSLContext or None
        await self.store.run(self.store.open)
        for outcome in ("completed", "failed", "retried"):  # every outcome's series exists from the start
            self.metrics.batch_lines.labels(outcome)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=max(self.settings.concurrency, 1), ssl=engine_tls if engine_tls is not None else True
            ),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._work()),
            loop.create_task(self._keep_leases()),
            loop.create_task(self._figures()),
        ]

    async def stop(self) -> None:
        """Stop sending. Lines in flight are let go unanswered and given back at once (sent again by
        another replica, or by this router after its restart; their send counts)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        lines = [request.line for request in self.in_flight.values()]
        for request in list(self.in_flight.values()):
            request.abandon()
        self.in_flight.clear()
        if self._jobs:  # store writes of ended lines, a validation or finalization under way
            _, pending = await asyncio.wait(set(self._jobs), timeout=STOP_JOBS_SECONDS)
            if pending:
                log.warning("stopping with %d batch jobs unfinished; their leases will run out", len(pending))
                for job in pending:
                    job.cancel()
        for line in lines:
            try:
                await self.store.run(self.store.release_line, line.batch_id, line.idx, time.time(), False)
            except Exception:  # noqa: BLE001 - the store is away: the lease runs out instead
                log.warning(
                    "could not give back batch line %s/%d; its lease will run out", line.batch_id, line.idx
                )
                break
        if self.session is not None:
            await self.session.close()
        await asyncio.to_thread(self.store.close)

    def wake(self) -> None:
        """There may be work now (a batch created or cancelled, a line ended)."""
        self._wakeup.set()

    def _spawn(self, job: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(job)
        self._jobs.add(task)
        task.add_done_callback(self._job_done)

    def _job_done(self, task: asyncio.Task[Any]) -> None:
        self._jobs.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("batch work failed", exc_info=task.exception())
        self.wake()

    # ---- the loops ---------------------------------------------------------------------------------------------
    async def _work(self) -> None:
        while True:
            self._wakeup.clear()
            try:
                await self._round()
            except Exception:  # noqa: BLE001 - a store outage: log it, try again next round
                log.exception("batch runner round failed")
                await asyncio.sleep(POLL_SECONDS)
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns normally when the event is set
            # just as the task is cancelled, so the loop lost its one cancellation and stop() waited for
            # ever (the suite's hang of test_batches_list_newest_first_with_cursor[7], reproduced here).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_SECONDS):
                    await self._wakeup.wait()

    async def _round(self) -> None:
        store = self.store
        now = time.time()
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_SECONDS
            if await store.run(store.expire_batches, now) or await store.run(store.finish_ready_batches, now):
                self.wake()
        if not self._busy:
            for status in (VALIDATING, FINALIZING, CANCELLING):
                batch = await store.run(store.claim_batch, status, now, self.settings.lease_seconds)
                if batch is not None:
                    self._busy.add(batch["id"])
                    job = self._validate(batch) if status == VALIDATING else self._finalize(batch)
                    self._spawn(job)
                    break
        free = min(self.settings.concurrency - len(self.in_flight) - len(self._preparing), self._room())
        if free <= 0 or time.monotonic() < self._paused_until:
            return
        lines = await store.run(
            store.claim_lines, free, now, self.settings.lease_seconds, self.settings.max_sends
        )
        for line in lines:  # each on its own: what goes wrong with one line is that line's alone
            self._preparing.add((line.batch_id, line.idx))
            self._spawn(self._send(line))

    async def _keep_leases(self) -> None:
        """The leases of what this router really works on renewed (lines being read or in flight, batches
        being validated or finalized), and lines waiting on a director stage past the request timeout
        answered. A line leased but lost track of (a fault here) is not renewed: its lease runs out and any
        router takes it again, so it cannot hold its batch, or another's, for ever."""
        interval = self.settings.lease_seconds / 3
        while True:
            await asyncio.sleep(interval)
            tick = time.perf_counter()
            for request in list(self.in_flight.values()):
                request.check_timeout(tick)
            lines = [*self.in_flight, *self._preparing]
            try:
                await self.store.run(
                    self.store.renew_leases, lines, list(self._busy), time.time(), self.settings.lease_seconds
                )
            except Exception:  # noqa: BLE001 - the store is away: the leases may run out, and be taken again
                log.exception("renewing the batch leases failed")

    async def _figures(self) -> None:
        metrics = self.metrics
        while True:
            try:
                statuses, waiting = await self.store.run(self.store.figures)
                for status in STATUSES:
                    metrics.batches.labels(status).set(statuses.get(status, 0))
                metrics.batch_queue_depth.set(waiting)
                metrics.batch_lines_in_flight.set(len(self.in_flight))
            except Exception:  # noqa: BLE001 - figures are best effort
                log.exception("reading the batch figures failed")
            await asyncio.sleep(FIGURES_SECONDS)

    # ---- validation ----------------------------------------------------------------------------------------------
    async def _validate(self, batch: dict[str, Any]) -> None:
        store = self.store
        try:
            path = self.files.path(batch["input_file_id"])
            try:
                checked = await asyncio.to_thread(
                    check_input, path, batch["endpoint"], self.router.max_body_bytes
                )
            except FileNotFoundError:  # deleting an active batch's input is refused: its volume is not this
                checked = CheckedInput()
                checked.error("input_file_missing", MISSING_INPUT)
                log.error("batch %s: its input file is not in %s", batch["id"], self.files.root)
            check_models(checked, lambda model: model_served(self.router, model))
            now = int(time.time())
            if checked.errors:
                errors = orjson.dumps({"object": "list", "data": checked.errors}).decode()
                await store.run(store.fail_batch, batch["id"], errors, now)
                log.info("batch %s failed validation (%d errors)", batch["id"], len(checked.errors))
                return
            model = next(iter(checked.models)) if len(checked.models) == 1 else None
            if await store.run(store.start_batch, batch["id"], model, checked.lines, now):
                log.info("batch %s in progress: %d lines", batch["id"], len(checked.lines))
        except Exception:
            await self._give_up(batch["id"])
            raise
        finally:
            self._busy.discard(batch["id"])

    async def _give_up(self, batch_id: str) -> None:
        """Validation or finalization failed here (a store or disk error): the batch is let go, for any
        router to take again after a pause, rather than held until it expires."""
        with contextlib.suppress(Exception):
            await self.store.run(self.store.release_batch, batch_id, time.time() + RETRY_BATCH_SECONDS)

    # ---- lines -----------------------------------------------------------------------------------------------------
    async def _send(self, line: ClaimedLine) -> None:
        """One leased line through the director (or failed at once when it cannot be sent). Whatever goes
        wrong here fails this line alone: it goes to the error file, counted, and the runner goes on."""
        key = (line.batch_id, line.idx)
        request_id = new_request_id()
        try:
            await self._prepare(line, request_id)
        except Exception:
            log.exception("batch %s: line %d could not be sent", line.batch_id, line.idx)
            request = self.in_flight.pop(key, None)
            if request is not None:  # started, not ended: its engine's booking goes back
                request.abandon()
            if not line.settled:
                self._record(line, request_id.decode(), 500, send_failed())
        finally:
            self._preparing.discard(key)
            self.metrics.batch_lines_in_flight.set(len(self.in_flight))

    async def _prepare(self, line: ClaimedLine, request_id: bytes) -> None:
        """The line's body read from its file (off the loop), its request resolved and started."""
        if line.sends < 0:  # sent max_sends times already, each time by a router that died
            body = error_body(
                502,
                f"The request was sent {-line.sends - 1} times; no answer was recorded.",
                code="batch_line_lost",
            )
            self._record(line, request_id.decode(), 502, body)
            return
        router = self.router
        try:
            async with self._reading:
                body = await asyncio.to_thread(self._read_body, line)
            ctx = resolve(router, line.endpoint, body, b"application/json", None, None, ())
            ctx.body = provider_body(router, ctx)  # an alias: the provider's own id (every leg)
        except RouterError as err:
            if err.status in SHED_STATUSES:
                self._shed(line)
            else:
                self._record(line, request_id.decode(), err.status, err.body())
            return
        except (OSError, ValueError) as exc:  # the input file changed or went away
            body = error_body(500, f"The input line could not be read again: {exc}", code="input_unreadable")
            self._record(line, request_id.decode(), 500, body)
            return
        if (line.batch_id, line.idx) not in self._preparing:  # its batch ended meanwhile
            return
        pool = ctx.pool or ctx.model
        roomy, crowded = self._engines_with_room(pool)
        if not roomy or router.director.queue.ahead(pool, -1):  # no free slot: wait for one
            self._shed(line)
            return
        if crowded:  # the scheduler picks among the engines with a free slot (prefix affinity included)
            ctx.excluded = crowded
        if ctx.priority >= 0:  # batch work is sheddable: interactive requests keep their latency
            ctx.priority = -1
            ctx.body = router.priority.engine_body(pool, -1, ctx.body, None)
        ctx.request_id = request_id
        ctx.arrived = time.perf_counter()
        request = self.in_flight[(line.batch_id, line.idx)] = BatchLineRequest(
            router.director, ctx, self, line
        )
        self._preparing.discard((line.batch_id, line.idx))
        self.metrics.batch_lines_in_flight.set(len(self.in_flight))
        request.start()  # (the director may refuse it at once: line_ended runs before this returns)

    def _read_body(self, line: ClaimedLine) -> bytes:
        """(on a worker thread) The line's body as it stands in the file: validation found the line at most
        ``max_body_bytes`` long and nested within the router's limit."""
        raw = self.files.read_range(line.input_file_id, line.start, line.length)
        return bytes(_LINE.decode(raw).body)

    def line_ended(self, request: BatchLineRequest, status: int, body: bytes, refused: bool) -> None:
        line = request.line
        self.in_flight.pop((line.batch_id, line.idx), None)
        self.metrics.batch_lines_in_flight.set(len(self.in_flight))
        if refused and status in SHED_STATUSES:
            self._shed(line)
        elif not refused and status in RETRY_STATUSES and line.sends < self.settings.max_sends:
            line.settled = True
            self.metrics.batch_lines.labels("retried").inc()
            self._spawn(self.store.run(self.store.release_line, line.batch_id, line.idx, time.time(), False))
        else:
            self._record(line, request.ctx.request_id.decode(), status, body)
        self.wake()

    def _room(self) -> int:
        """Batch lines the healthy engines take now, in all."""
        settings = self.settings
        now = time.monotonic()
        return sum(
            background_room(e, settings.reserve_slots, settings.max_kv_cache_usage, now)
            for e in self.router.registry.engines()
            if e.healthy
        )

    def _engines_with_room(self, pool: str) -> tuple[list[Engine], set[str]]:
        """The model's engines that take a batch line now, and the names of those that do not."""
        settings = self.settings
        now = time.monotonic()
        roomy: list[Engine] = []
        crowded: set[str] = set()
        for engine in self.router.registry.candidates(pool):
            if background_room(engine, settings.reserve_slots, settings.max_kv_cache_usage, now):
                roomy.append(engine)
            else:
                crowded.add(engine.name)
        return roomy, crowded

    def _shed(self, line: ClaimedLine) -> None:
        """No engine of the line's model has a slot to spare, or the director shed it: the line waits,
        unsent, and the runner backs off."""
        line.settled = True
        self._backoff = min(max(self._backoff * 2, 0.1), MAX_BACKOFF)
        self._paused_until = time.monotonic() + self._backoff
        self.metrics.batch_lines.labels("retried").inc()
        not_before = time.time() + self._backoff
        self._spawn(self.store.run(self.store.release_line, line.batch_id, line.idx, not_before, True))

    def _record(self, line: ClaimedLine, request_id: str, status: int, body: bytes) -> None:
        line.settled = True
        if status == 200:
            self._backoff = 0.0
        failed = status != 200
        self.metrics.batch_lines.labels("failed" if failed else "completed").inc()
        result = result_line(line.custom_id, request_id, status, body)
        self._spawn(
            self.store.run(self.store.finish_line, line.batch_id, line.idx, failed, result, time.time())
        )

    def abandon_batch(self, batch_id: str) -> None:
        """The batch ended here (cancelled, expired): its lines in flight are let go."""
        self._preparing = {key for key in self._preparing if key[0] != batch_id}
        for key, request in list(self.in_flight.items()):
            if key[0] == batch_id:
                del self.in_flight[key]
                request.abandon()
        self.metrics.batch_lines_in_flight.set(len(self.in_flight))

    # ---- finalization ---------------------------------------------------------------------------------------------
    async def _finalize(self, batch: dict[str, Any]) -> None:
        """Write the batch's output and error files from its lines' results, then give it its final status.
        Done again from the start by any router when the one doing it dies (the files' ids are the batch's)."""
        store = self.store
        batch_id = batch["id"]
        ending = batch["ending"] or (CANCELLED if batch["status"] == CANCELLING else COMPLETED)
        try:
            await store.run(store.close_lines, batch_id)
            self.abandon_batch(batch_id)
            written = await asyncio.to_thread(self._write_files, batch_id, ending)
            files, counts = written
            if await store.run(store.end_batch, batch_id, ending, files, counts, int(time.time())):
                log.info("batch %s %s: %d completed, %d failed", batch_id, ending, *counts)
        except Exception:
            await self._give_up(batch_id)
            raise
        finally:
            self._busy.discard(batch_id)

    def _write_files(self, batch_id: str, ending: str) -> tuple[list[tuple[str, str, int]], tuple[int, int]]:
        """(runs on a worker thread; the store's calls go to the store's thread as elsewhere)"""
        loop_store = self.store
        unsent = UNSENT.get(ending, ("batch_failed", "This request was not executed."))
        paths = {kind: self.files.temporary() for kind in ("output", "error")}
        sizes = {"output": 0, "error": 0}
        ok = failed = 0
        with open(paths["output"], "wb") as output, open(paths["error"], "wb") as errors:
            after = -1
            while True:
                rows = loop_store.call_blocking(loop_store.results, batch_id, after, RESULT_PAGE)
                if not rows:
                    break
                for idx, custom_id, line_failed, result in rows:
                    after = idx
                    if result is None:
                        errors.write(unsent_line(custom_id, *unsent) + b"\n")
                        failed += 1
                    elif line_failed:
                        errors.write(result.encode() + b"\n")
                        failed += 1
                    else:
                        output.write(result.encode() + b"\n")
                        ok += 1
            sizes["output"], sizes["error"] = output.tell(), errors.tell()
        files = []
        for kind, path in paths.items():
            if sizes[kind]:
                file_id = output_file_id(batch_id, kind)
                self.files.publish(path, file_id)
                files.append((file_id, f"{batch_id}_{kind}.jsonl", sizes[kind]))
            else:
                path.unlink()
        return files, (ok, failed)
