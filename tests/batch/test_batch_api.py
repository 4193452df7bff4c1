"""The Batch API on one router (SQLite) over stub engines: OpenAI's SDK unchanged, the shapes of files,
batches, output and error lines, and OpenAI's validation errors."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import openai
import pytest

from tests.batch.helpers import create_batch, file_lines, input_lines, jsonl, upload, wait_batch
from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import running_router, stubs

MODEL = "stub-model"


@pytest.fixture
async def batch_router(tmp_path: Path):  # noqa: ANN201 - (url, router, engines)
    engines = [StubEngine("s1", [MODEL]), StubEngine("s2", [MODEL])]
    async with (
        stubs(*engines) as urls,
        running_router(urls, batch_api=True, batch_dir=str(tmp_path / "batch")) as (url, router),
    ):
        yield url, router, engines


async def test_openai_sdk_files_and_batches(batch_router) -> None:  # noqa: ANN001
    url, router, engines = batch_router
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    content = jsonl(input_lines(20, MODEL))
    created = await sdk.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    assert created.id.startswith("file-") and created.bytes == len(content) and created.purpose == "batch"
    assert created.filename == "in.jsonl"
    batch = await sdk.batches.create(
        input_file_id=created.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        done = await wait_batch(http, batch.id, {"completed"})
    retrieved = await sdk.batches.retrieve(batch.id)
    assert retrieved.status == "completed"
    assert retrieved.request_counts.total == 20 and retrieved.request_counts.completed == 20
    assert retrieved.request_counts.failed == 0 and retrieved.error_file_id is None
    assert done["in_progress_at"] and done["finalizing_at"] and done["completed_at"]
    output = (await sdk.files.content(retrieved.output_file_id)).content
    lines = [__import__("orjson").loads(line) for line in output.splitlines()]
    assert [line["custom_id"] for line in lines] == [f"req-{n}" for n in range(20)]
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in lines)
    assert all(line["response"]["body"]["object"] == "chat.completion" for line in lines)
    listed = await sdk.batches.list(limit=10)
    assert [b.id for b in listed.data] == [batch.id]
    assert sum(e.completed for e in engines) >= 20  # the lines were answered by the engines


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/embeddings"])
async def test_other_endpoints(batch_router, endpoint: str) -> None:  # noqa: ANN001
    url, _, _ = batch_router
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        file_id = (await upload(http, jsonl(input_lines(3, MODEL, endpoint)))).json()["id"]
        batch = (await create_batch(http, file_id, endpoint)).json()
        done = await wait_batch(http, batch["id"], {"completed", "failed"})
        assert done["status"] == "completed", done
        lines = await file_lines(http, done["output_file_id"])
        assert len(lines) == 3 and all(line["response"]["status_code"] == 200 for line in lines)


async def test_invalid_input_fails_with_openai_errors(batch_router) -> None:  # noqa: ANN001
    url, _, engines = batch_router
    good = input_lines(2, MODEL)
    bad = [
        good[0],
        b"{not json",
        {**good[1], "custom_id": "req-0"},  # duplicate
        {**good[1], "custom_id": "x1", "url": "/v1/completions"},
        {**good[1], "custom_id": "x2", "method": "GET"},
        {**good[1], "custom_id": "x3", "body": {**good[1]["body"], "model": "no-such-model"}},
    ]
    before = sum(e.completed for e in engines)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        file_id = (await upload(http, jsonl(bad))).json()["id"]
        batch = (await create_batch(http, file_id)).json()
        done = await wait_batch(http, batch["id"], {"failed", "completed"})
    assert done["status"] == "failed" and done["failed_at"]
    errors = done["errors"]["data"]
    got = {(e["code"], e["line"]) for e in errors}
    assert ("invalid_json_line", 2) in got
    assert ("duplicate_custom_id", 3) in got
    assert ("invalid_url", 4) in got
    assert ("invalid_method", 5) in got
    assert ("model_not_found", 6) in got
    assert all(set(e) == {"code", "message", "param", "line"} for e in errors)
    assert sum(e.completed for e in engines) == before  # nothing of a failed batch is sent


async def test_request_errors(batch_router, tmp_path: Path) -> None:  # noqa: ANN001
    url, _, _ = batch_router
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        wrong_purpose = await upload(http, b"{}\n", purpose="fine-tune")
        assert wrong_purpose.status_code == 400 and wrong_purpose.json()["error"]["param"] == "purpose"
        missing = await http.get("/v1/batches/batch_nope")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        file_id = (await upload(http, jsonl(input_lines(1, MODEL)))).json()["id"]
        for doc, param in (
            ({"input_file_id": file_id, "endpoint": "/v1/responses", "completion_window": "24h"}, "endpoint"),
            (
                {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "1h"},
                "completion_window",
            ),
            (
                {"input_file_id": "file-none", "endpoint": "/v1/completions", "completion_window": "24h"},
                "input_file_id",
            ),
        ):
            answer = await http.post("/v1/batches", json=doc)
            assert answer.status_code in (400, 404) and answer.json()["error"]["param"] == param, answer.text
        assert (await http.put("/v1/batches")).status_code == 405
        assert (await http.get(f"/v1/files/{file_id}")).json()["purpose"] == "batch"
        deleted = await http.delete(f"/v1/files/{file_id}")
        assert deleted.json() == {"id": file_id, "object": "file", "deleted": True}
        assert (await http.get(f"/v1/files/{file_id}/content")).status_code == 404


async def test_one_keys_files_and_batches_are_not_anothers(tmp_path: Path) -> None:
    async with (
        stubs(StubEngine("s1", [MODEL])) as urls,
        running_router(
            urls,
            environ={"VLLM_STACK_API_KEYS": "key-a,key-b"},
            batch_api=True,
            batch_dir=str(tmp_path / "batch"),
        ) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=30, headers={"authorization": "Bearer key-a"}) as a,
        httpx.AsyncClient(base_url=url, timeout=30, headers={"authorization": "Bearer key-b"}) as b,
        httpx.AsyncClient(base_url=url, timeout=30) as nobody,
    ):
        file_id = (await upload(a, jsonl(input_lines(2, MODEL)))).json()["id"]
        batch = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        assert (await b.post("/v1/batches", json=batch)).status_code == 404  # b cannot use a's file
        batch_id = (await a.post("/v1/batches", json=batch)).json()["id"]
        done = await wait_batch(a, batch_id, {"completed"})
        for path in (
            f"/v1/files/{file_id}",
            f"/v1/files/{done['output_file_id']}/content",
            f"/v1/batches/{batch_id}",
        ):
            assert (await b.get(path)).status_code == 404, path
            assert (await nobody.get(path)).status_code == 401, path
        assert (await b.get("/v1/batches")).json()["data"] == []
        assert (await b.get("/v1/files")).json()["data"] == []
        assert (await b.post(f"/v1/batches/{batch_id}/cancel")).status_code == 404
        assert (await b.delete(f"/v1/files/{file_id}")).status_code == 404
        assert [f["id"] for f in (await a.get("/v1/files")).json()["data"]] == [
            done["output_file_id"],
            file_id,
        ]
