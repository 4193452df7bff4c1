"""Two router replicas share batches through a real PostgreSQL server (row leases, FOR UPDATE SKIP LOCKED)
and one batch directory (as a ReadWriteMany volume would be): a file uploaded to one is a batch's input on
the other, both send lines, and when one is killed mid-batch (SIGKILL) the other finishes the batch with
every line in the output exactly once; a line that was in flight on the dead replica is sent again once,
after its lease ran out."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.batch.helpers import (
    RouterProcess,
    create_batch,
    file_lines,
    input_lines,
    jsonl,
    upload,
    wait_batch,
)
from tests.batch.test_restart import sends_per_line
from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import stubs, wait_for

pytestmark = pytest.mark.postgres

MODEL = "stub-model"
LINES = 80
CONCURRENCY = 3
LEASE = 2.0


def in_flight(metrics: str) -> float:
    """The replica's batch lines started and not yet answered (its gauge)."""
    for line in metrics.splitlines():
        if line.startswith("vllm_stack_router_batch_lines_in_flight "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def lines_done(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith('vllm_stack_router_batch_lines_total{outcome="completed"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_two_replicas_share_a_batch_and_one_dies(tmp_path: Path, postgres_dsn: str) -> None:
    engines = [StubEngine("s1", [MODEL]), StubEngine("s2", [MODEL])]
    for engine in engines:
        engine.behaviour.delay_s = 0.1
    args = ("--batch-lease-seconds", str(LEASE), "--batch-concurrency", str(CONCURRENCY))
    shared = tmp_path / "batch"
    async with stubs(*engines) as urls:
        doomed = RouterProcess(urls, shared, tmp_path / "a.log", *args, database_url=postgres_dsn)
        survivor = RouterProcess(urls, shared, tmp_path / "b.log", *args, database_url=postgres_dsn)
        try:
            await doomed.ready()
            await survivor.ready()
            async with (
                httpx.AsyncClient(base_url=doomed.url, timeout=30) as a,
                httpx.AsyncClient(base_url=survivor.url, timeout=30) as b,
            ):
                file_id = (await upload(a, jsonl(input_lines(LINES, MODEL)))).json()["id"]
                created = await create_batch(b, file_id)
                assert created.status_code == 200, created.text  # the file is known to the other replica
                batch_id = created.json()["id"]
                await wait_for(lambda: sum(e.completed for e in engines) >= 20, within=30, what="20 answered")
                assert lines_done((await a.get("/metrics")).text) > 0  # both replicas send lines
                assert lines_done((await b.get("/metrics")).text) > 0
                for engine in engines:  # what is sent from now on stays in flight until the kill
                    engine.behaviour.delay_s = 4
                # The doomed replica has a line on an engine, and every line either replica started has
                # reached one (a replica sends its lines one after another, as their bodies are read): what
                # is in flight at the kill is then exactly what the engines hold.
                deadline = time.monotonic() + 30
                while True:
                    started = [in_flight((await r.get("/metrics")).text) for r in (a, b)]
                    held = sum(sends_per_line(engines).values()) - sum(e.completed for e in engines)
                    if started[0] >= 1 and held == sum(started) and held > 0:
                        break
                    assert time.monotonic() < deadline, (
                        f"the doomed replica's lines on engines: {started}, {held}"
                    )
                    await asyncio.sleep(0.02)
                doomed.kill()
                killed_at = time.monotonic()
                for engine in engines:
                    engine.behaviour.delay_s = 0.1
                done = await wait_batch(b, batch_id, {"completed"}, within=90)
                output = await file_lines(b, done["output_file_id"])
                errors = await file_lines(b, done["error_file_id"])
                finished_after = time.monotonic() - killed_at
        finally:
            doomed.stop()
            survivor.stop()
    assert not errors
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{n}" for n in range(LINES))
    assert done["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    sent = sends_per_line(engines)
    assert set(sent) == {f"line {n}" for n in range(LINES)}
    assert all(count <= 2 for count in sent.values()), sent  # a dead replica's line is re-sent once at most
    resent = [line for line, count in sent.items() if count == 2]
    assert 1 <= len(resent) <= CONCURRENCY  # the dead replica's lines in flight, nothing else
    assert finished_after >= LEASE * 2 / 3  # re-sent only once their lease (renewed every third) ran out
    with psycopg.connect(postgres_dsn) as conn:
        states = conn.execute("SELECT state, COUNT(*), MAX(sends) FROM vs_lines GROUP BY state").fetchall()
    assert states == [("done", LINES, 2)]
