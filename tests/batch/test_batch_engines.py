"""The Batch API against real vLLM engines: chat completions, completions and embeddings batches through
OpenAI's SDK; and two router replicas sharing a batch through a real PostgreSQL server, one killed mid-batch
(SIGKILL), the other finishing it with every line once and no line sent more than twice."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import openai
import orjson
import psycopg
import pytest
from vllm_stack_dev.testbed.engines import Engine, EngineGroup

from tests.batch.helpers import (
    RouterProcess,
    create_batch,
    file_lines,
    input_lines,
    jsonl,
    upload,
    wait_batch,
)
from tests.conftest import CHAT_MODEL, EMBED_MODEL
from tests.router.helpers import running_router, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.postgres]


async def test_sdk_batches_on_real_engines(
    engines: EngineGroup, embedding_engine: Engine, tmp_path: Path
) -> None:
    async with running_router(
        [*engines.urls, embedding_engine.url], batch_api=True, batch_dir=str(tmp_path / "batch")
    ) as (url, _):
        sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        for endpoint, model in (
            ("/v1/chat/completions", CHAT_MODEL),
            ("/v1/completions", CHAT_MODEL),
            ("/v1/embeddings", EMBED_MODEL),
        ):
            content = jsonl(input_lines(6, model, endpoint, max_tokens=8))
            uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
            batch = await sdk.batches.create(
                input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h"
            )
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                done = await wait_batch(http, batch.id, {"completed", "failed"}, within=180)
            assert done["status"] == "completed" and done["request_counts"]["completed"] == 6, done
            output = [
                orjson.loads(line)
                for line in (await sdk.files.content(done["output_file_id"])).content.splitlines()
            ]
            assert sorted(line["custom_id"] for line in output) == sorted(f"req-{n}" for n in range(6))
            bodies = [line["response"]["body"] for line in output]
            if endpoint == "/v1/embeddings":
                assert all(len(body["data"][0]["embedding"]) > 0 for body in bodies)
            else:
                assert all(
                    body["usage"]["completion_tokens"] > 0 and body["model"] == model for body in bodies
                )


LINES = 40
CONCURRENCY = 3


def leased_by(dsn: str, pid: int) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT COUNT(*) FROM vs_lines WHERE state = 'leased' AND owner LIKE %s", (f"%-{pid}-%",)
        ).fetchone()
    return int(row[0]) if row else 0


async def test_two_replicas_on_postgres_one_killed(
    engines: EngineGroup, tmp_path: Path, postgres_dsn: str
) -> None:
    args = ("--batch-lease-seconds", "3", "--batch-concurrency", str(CONCURRENCY))
    shared = tmp_path / "batch"
    doomed = RouterProcess(engines.urls, shared, tmp_path / "a.log", *args, database_url=postgres_dsn)
    survivor = RouterProcess(engines.urls, shared, tmp_path / "b.log", *args, database_url=postgres_dsn)
    try:
        await doomed.ready(180)
        await survivor.ready(180)
        async with httpx.AsyncClient(base_url=survivor.url, timeout=60) as http:
            file_id = (await upload(http, jsonl(input_lines(LINES, CHAT_MODEL, max_tokens=24)))).json()["id"]
            batch_id = (await create_batch(http, file_id)).json()["id"]
            await wait_batch(http, batch_id, {"in_progress"})
            await wait_for(
                lambda: leased_by(postgres_dsn, doomed.process.pid) >= 1, within=60, what="lines leased"
            )
            doomed.kill()
            orphaned = leased_by(postgres_dsn, doomed.process.pid)
            done = await wait_batch(http, batch_id, {"completed"}, within=300)
            output = await file_lines(http, done["output_file_id"])
            errors = await file_lines(http, done["error_file_id"])
    finally:
        doomed.stop()
        survivor.stop()
    assert 1 <= orphaned <= CONCURRENCY
    assert not errors and done["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{n}" for n in range(LINES))
    assert all(line["response"]["status_code"] == 200 for line in output)
    with psycopg.connect(postgres_dsn) as conn:
        sends = dict(conn.execute("SELECT sends, COUNT(*) FROM vs_lines GROUP BY sends").fetchall())
    assert set(sends) <= {1, 2} and sends.get(2, 0) == orphaned, sends  # the dead one's, once more
