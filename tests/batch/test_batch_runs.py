"""How batches run on one router over stub engines: held back while the engines are saturated and sent
after, an engine's failure retried and its error answers kept, expiry and cancellation with every input
line in the output or the error file exactly once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.batch.helpers import create_batch, file_lines, input_lines, jsonl, start_batch, upload, wait_batch
from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import metric_value, running_router, stubs, wait_for
from vllm_stack.app import Router

MODEL = "stub-model"


@contextlib.asynccontextmanager
async def batch_stack(
    tmp_path: Path, engines: list[StubEngine], **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Router]]:
    async with (
        stubs(*engines) as urls,
        running_router(urls, batch_api=True, batch_dir=str(tmp_path / "batch"), **settings) as (url, router),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        yield http, router


def _waiting(engine: Any) -> float:  # noqa: ANN401 - a registry Engine
    telemetry = engine.fresh_telemetry()
    return 0.0 if telemetry is None else telemetry.waiting


async def every_line_once(http: httpx.AsyncClient, batch: dict[str, Any], count: int) -> tuple[list, list]:
    """The batch's output and error lines; each input line's custom id in exactly one of them, once."""
    output = await file_lines(http, batch["output_file_id"])
    errors = await file_lines(http, batch["error_file_id"])
    ids = [line["custom_id"] for line in output + errors]
    assert sorted(ids) == sorted(f"req-{n}" for n in range(count)), ids
    return output, errors


async def test_saturated_engines_get_no_batch_lines_until_they_have_room(tmp_path: Path) -> None:
    engines = [StubEngine("s1", [MODEL]), StubEngine("s2", [MODEL])]
    for engine in engines:
        engine.waiting = 20  # every engine saturated (saturation_max_waiting 5)
    async with batch_stack(tmp_path, engines) as (http, router):
        await wait_for(
            lambda: all(_waiting(e) >= 20 for e in router.registry.engines()), what="scraped figures"
        )
        batch_id = await start_batch(http, input_lines(10, MODEL))
        await wait_for(lambda: metric_value(router, "vllm_stack_router_batches", status="in_progress") == 1)
        await wait_for(lambda: metric_value(router, "vllm_stack_router_batch_queue_depth") == 10)
        assert sum(e.completed for e in engines) == 0  # no engine has a slot to spare: none is sent
        interactive = asyncio.create_task(
            http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
        )
        await wait_for(lambda: router.queue.length == 1, what="the interactive request queued, not shed")
        for engine in engines:
            engine.waiting = 0
        assert (await interactive).status_code == 200
        done = await wait_batch(http, batch_id, {"completed"})
        output, errors = await every_line_once(http, done, 10)
        assert len(output) == 10 and not errors and done["request_counts"]["completed"] == 10


async def test_engine_failures_are_retried_and_error_answers_kept(tmp_path: Path) -> None:
    engine = StubEngine("s1", [MODEL])
    engine.behaviour.fail_statuses = [503, 502, 400]
    async with batch_stack(tmp_path, [engine], batch_concurrency=1) as (http, router):
        batch_id = await start_batch(http, input_lines(5, MODEL))
        done = await wait_batch(http, batch_id, {"completed"})
        output, errors = await every_line_once(http, done, 5)
        assert len(output) == 4 and len(errors) == 1
        assert errors[0]["response"]["status_code"] == 400 and errors[0]["error"] is None
        assert errors[0]["response"]["body"]["error"]["code"] == 400  # the engine's answer, as it came
        assert done["request_counts"] == {"total": 5, "completed": 4, "failed": 1}
        assert metric_value(router, "vllm_stack_router_batch_lines_total", outcome="retried") == 2


async def test_a_line_failing_every_send_goes_to_the_error_file(tmp_path: Path) -> None:
    engine = StubEngine("s1", [MODEL])
    engine.behaviour.fail_statuses = [503] * 3
    async with batch_stack(tmp_path, [engine], batch_concurrency=1) as (http, _):
        batch_id = await start_batch(http, input_lines(1, MODEL))
        done = await wait_batch(http, batch_id, {"completed"})
        _, errors = await every_line_once(http, done, 1)
        assert [e["response"]["status_code"] for e in errors] == [503]  # sent 3 times (max_sends), then kept
        assert len(engine.seen) == 3


async def test_expiry_ends_a_batch_with_each_line_once(tmp_path: Path) -> None:
    engine = StubEngine("s1", [MODEL])
    engine.behaviour.delay_s = 0.3
    async with batch_stack(tmp_path, [engine], batch_concurrency=1, batch_completion_window=1.5) as (http, _):
        batch_id = await start_batch(http, input_lines(30, MODEL))
        done = await wait_batch(http, batch_id, {"expired"})
        output, errors = await every_line_once(http, done, 30)
        assert output and errors and done["expired_at"]
        unsent = [e for e in errors if e["response"] is None]
        assert unsent and all(e["error"]["code"] == "batch_expired" for e in unsent)
        counts = done["request_counts"]
        assert (
            counts["total"] == 30 and counts["completed"] == len(output) and counts["failed"] == len(errors)
        )


async def test_cancel_ends_a_batch_with_each_line_once(tmp_path: Path) -> None:
    engine = StubEngine("s1", [MODEL])
    engine.behaviour.delay_s = 0.2
    async with batch_stack(tmp_path, [engine], batch_concurrency=2) as (http, _):
        batch_id = await start_batch(http, input_lines(40, MODEL))
        await wait_for(lambda: engine.completed >= 4, what="some lines answered")
        cancelling = await http.post(f"/v1/batches/{batch_id}/cancel")
        assert cancelling.status_code == 200 and cancelling.json()["status"] in ("cancelling", "cancelled")
        done = await wait_batch(http, batch_id, {"cancelled"})
        output, errors = await every_line_once(http, done, 40)
        assert len(output) >= 4 and done["cancelled_at"] and done["cancelling_at"]
        assert all(e["error"]["code"] == "batch_cancelled" for e in errors if e["response"] is None)
        sent = len(engine.seen)
        again = await http.post(f"/v1/batches/{batch_id}/cancel")
        assert again.status_code == 200 and again.json()["status"] == "cancelled"  # as it is
        await asyncio.sleep(0.5)  # (a runner that still sent lines would have sent some by now)
        assert len(engine.seen) == sent  # nothing more was sent
        finished = await start_batch(http, input_lines(1, MODEL))
        await wait_batch(http, finished, {"completed"})
        late = await http.post(f"/v1/batches/{finished}/cancel")
        assert late.status_code == 409 and late.json()["error"]["code"] == "invalid_status"


@pytest.mark.parametrize("count", [1, 7])
async def test_batches_list_newest_first_with_cursor(tmp_path: Path, count: int) -> None:
    async with batch_stack(tmp_path, [StubEngine("s1", [MODEL])]) as (http, _):
        ids = [await start_batch(http, input_lines(1, MODEL)) for _ in range(count)]
        first = (await http.get("/v1/batches", params={"limit": 3})).json()
        assert [b["id"] for b in first["data"]] == list(reversed(ids))[:3]
        assert first["has_more"] == (count > 3)
        if count > 3:
            rest = (await http.get("/v1/batches", params={"after": first["last_id"], "limit": 10})).json()
            assert [b["id"] for b in rest["data"]] == list(reversed(ids))[3:]


async def test_a_missing_input_fails_the_batch_and_an_error_in_validation_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_stack.batch import runner as runner_module

    real_check = runner_module.check_input
    calls = []

    def flaky_check(*args: Any) -> Any:  # noqa: ANN401 - the first validation hits a disk error
        calls.append(args)
        if len(calls) == 1:
            raise OSError("a transient disk error")
        return real_check(*args)

    monkeypatch.setattr(runner_module, "check_input", flaky_check)
    monkeypatch.setattr(runner_module, "RETRY_BATCH_SECONDS", 0.2)
    async with batch_stack(tmp_path, [StubEngine("s1", [MODEL])]) as (http, _):
        retried = await start_batch(http, input_lines(3, MODEL))
        done = await wait_batch(http, retried, {"completed", "failed"})
        assert done["status"] == "completed" and len(calls) == 2  # let go after the error, taken again
        file_id = (await upload(http, jsonl(input_lines(2, MODEL)))).json()["id"]
        (tmp_path / "batch" / "files" / file_id).unlink()  # a volume that is not the one it was written to
        missing = await create_batch(http, file_id)
        failed = await wait_batch(http, missing.json()["id"], {"failed", "completed"})
        assert failed["status"] == "failed"
        assert [e["code"] for e in failed["errors"]["data"]] == ["input_file_missing"]
