"""What one client's batch lines or uploads must not do to the runner or to other clients (issue 44's third
probe round): a line the runner cannot send fails alone, a line too deep or too large fails validation, the
runner renews only the leases it works on, an upload keeps only known small fields, errors quote short, and
405s and cursors behave."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.batch.helpers import create_batch, file_lines, input_lines, jsonl, upload, wait_batch
from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import _awaiting, bounded, running_router, stubs, wait_for
from vllm_stack.app import build_router
from vllm_stack.batch import files, validation
from vllm_stack.batch import runner as runner_module
from vllm_stack.batch.store import BatchStore
from vllm_stack.json_depth import MAX_JSON_DEPTH
from vllm_stack.server import body_stream

MODEL = "stub-model"
KEYS = {"VLLM_STACK_API_KEYS": "key-a,key-b"}


def nested(depth: int) -> bytes:
    """A JSON list nested ``depth`` deep (the outermost counts as 1); orjson cannot write one past 254."""
    return b"[" * depth + b"]" * depth


def deep_line(custom_id: str, depth: int) -> bytes:
    """A chat line whose body holds ``nested(depth)`` one level in (the body nests ``depth + 1``)."""
    return orjson.dumps(_line(custom_id, _chat("@@"))).replace(b'"@@"', nested(depth))


def _line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _chat(extra: Any = None) -> dict[str, Any]:  # noqa: ANN401
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if extra is not None:
        body["metadata_tree"] = extra
    return body


# ---- validation --------------------------------------------------------------------------------------------------
def test_validation_refuses_a_body_deeper_than_the_routers_limit_and_takes_one_at_it(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([deep_line("at", MAX_JSON_DEPTH - 1), deep_line("deep", 300)]))
    checked = validation.check_input(path, "/v1/chat/completions", 1 << 20)
    assert [(e["code"], e["line"], e["param"]) for e in checked.errors] == [("invalid_request", 2, "body")]
    assert str(MAX_JSON_DEPTH) in checked.errors[0]["message"]
    assert [cid for _, cid, _, _ in checked.lines] == ["at"]


def test_a_line_longer_than_the_body_limit_fails_without_being_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    big = _line("big", _chat("x" * 20_000_000))  # 20 MB on one line
    path.write_bytes(jsonl([_line("a", _chat()), big, _line("b", _chat())]))
    tracemalloc.start()
    try:
        checked = validation.check_input(path, "/v1/chat/completions", 64 * 1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * validation.SKIP_CHUNK, peak  # a chunk at a time, never the line
    assert [(e["code"], e["line"]) for e in checked.errors] == [("line_too_large", 2)]
    assert str(64 * 1024) in checked.errors[0]["message"]
    assert [cid for _, cid, _, _ in checked.lines] == ["a", "b"]
    data = path.read_bytes()
    _, _, start, length = checked.lines[1]
    assert orjson.loads(data[start : start + length])["custom_id"] == "b"  # offsets past the skipped line


def test_errors_quote_bad_values_short(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    lines = [
        {"custom_id": f"m{n}", "method": "X" * 1_000_000, "url": "/v1/chat/completions", "body": _chat()}
        for n in range(3)
    ]
    lines.append({"custom_id": "u", "method": "POST", "url": "/v" + "u" * 100_000, "body": _chat()})
    lines.append({"custom_id": "u", "method": "POST", "url": "/v1/chat/completions", "body": _chat()})
    lines.append(_line("c" * 50_000, _chat()))
    lines.append(_line("c" * 50_000, _chat()))
    path.write_bytes(jsonl(lines))
    checked = validation.check_input(path, "/v1/chat/completions", 4 << 20)
    assert [e["code"] for e in checked.errors] == ["invalid_method"] * 3 + ["invalid_url"] + [
        "duplicate_custom_id"
    ] * 2
    assert all(len(e["message"]) < 200 for e in checked.errors), [len(e["message"]) for e in checked.errors]
    assert len(orjson.dumps(checked.errors)) < validation.MAX_ERRORS * 400


# ---- the runner ----------------------------------------------------------------------------------------------------
async def test_a_line_the_runner_cannot_send_fails_alone_and_another_keys_batch_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any exception while sending a line (here a fault injected where the line's request is resolved)
    fails that line alone: the round goes on, the poisoned batch ends with it in the error file, and
    another key's batch, claimed in the same rounds, completes."""
    real_resolve = runner_module.resolve

    def faulty_resolve(router: Any, path: str, body: bytes, *args: Any) -> Any:  # noqa: ANN401
        if b"poison" in body:
            raise TypeError("a fault while preparing the line")
        return real_resolve(router, path, body, *args)

    monkeypatch.setattr(runner_module, "resolve", faulty_resolve)
    poisoned_lines = [_line("poison-0", _chat("poison"))] + input_lines(5, MODEL, prefix="a")
    async with (
        stubs(StubEngine("s1", [MODEL])) as urls,
        running_router(
            urls, environ=KEYS, batch_api=True, batch_dir=str(tmp_path / "batch"), batch_lease_seconds=1.5
        ) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=30, headers={"authorization": "Bearer key-a"}) as a,
        httpx.AsyncClient(base_url=url, timeout=30, headers={"authorization": "Bearer key-b"}) as b,
    ):
        poisoned_file = (await upload(a, jsonl(poisoned_lines))).json()["id"]
        clean_file = (await upload(b, jsonl(input_lines(20, MODEL)))).json()["id"]
        poisoned = (await create_batch(a, poisoned_file)).json()["id"]
        clean = (await create_batch(b, clean_file)).json()["id"]
        done_clean = await wait_batch(b, clean, {"completed", "failed"}, within=30)
        assert done_clean["status"] == "completed"
        assert done_clean["request_counts"] == {"total": 20, "completed": 20, "failed": 0}
        done_poisoned = await wait_batch(a, poisoned, {"completed", "failed"}, within=30)
        assert done_poisoned["request_counts"] == {"total": 6, "completed": 5, "failed": 1}
        errors = await file_lines(a, done_poisoned["error_file_id"])
        assert [(e["custom_id"], e["response"]["body"]["error"]["code"]) for e in errors] == [
            ("poison-0", "line_send_failed")
        ]


async def test_a_line_changed_on_disk_after_validation_is_refused_as_a_client_request_is(
    tmp_path: Path,
) -> None:
    """The runner sends a line's body as it stands in the file, through the request path's own checks: a
    line rewritten after validation to nest 300 deep is that line's 400, not a fault of the runner."""
    lines = [_line(f"l{n}", _chat("p" * 2000)) for n in range(3)]
    async with (
        stubs(StubEngine("s1", [MODEL])) as urls,
        running_router(
            urls,
            batch_api=True,
            batch_dir=str(tmp_path / "batch"),
            batch_concurrency=1,
            batch_reserve_slots=0,
        ) as (url, router),
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        file_id = (await upload(http, jsonl(lines))).json()["id"]
        path = tmp_path / "batch" / "files" / file_id
        data = bytearray(path.read_bytes())
        deep = nested(300)
        at = data.index(b"p" * 2000) - 1  # the string (quotes included), inside the first line's body
        data[at : at + 2002] = deep.ljust(
            2002
        )  # the same length: the others stay where validation found them
        runner = router.batch
        assert runner is not None
        runner._paused_until = time.monotonic() + 3600  # noqa: SLF001 - hold sending until the file changed
        batch_id = (await create_batch(http, file_id)).json()["id"]
        await wait_batch(http, batch_id, {"in_progress"})
        path.write_bytes(bytes(data))
        runner._paused_until = 0.0  # noqa: SLF001
        runner.wake()
        done = await wait_batch(http, batch_id, {"completed", "failed"}, within=30)
        errors = await file_lines(http, done["error_file_id"])
        assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("l0", 400)]
        assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}


def test_leases_are_renewed_only_for_the_lines_named(tmp_path: Path) -> None:
    store = BatchStore(None, tmp_path, "me")
    store.open()
    try:
        store.add_batch(
            {
                "id": "batch_1", "endpoint": "/v1/chat/completions", "input_file_id": "file-1",
                "completion_window": "24h", "status": "validating", "created_at": 0, "expires_at": 10**10,
                "metadata": None, "tenant": "t",
            }
        )  # fmt: skip
        assert store.claim_batch("validating", 0, 30.0) is not None
        store.start_batch("batch_1", MODEL, [(0, "a", 0, 10), (1, "b", 10, 10)], 0)
        now = time.time()
        claimed = store.claim_lines(2, now, 5.0, 3)
        assert [c.idx for c in claimed] == [0, 1]
        store.renew_leases([("batch_1", 0)], [], now + 4.0, 5.0)
        # line 1's lease ran out (nobody works on it): another router takes it; line 0's runs on
        retaken = store.claim_lines(2, now + 6.0, 5.0, 3)
        assert [(c.idx, c.sends) for c in retaken] == [(1, 2)]
    finally:
        store.close()


# ---- uploads and the API -------------------------------------------------------------------------------------------
@pytest.fixture
async def keyed_router(tmp_path: Path):  # noqa: ANN201 - (url, router)
    async with (
        stubs(StubEngine("s1", [MODEL])) as urls,
        running_router(urls, environ=KEYS, batch_api=True, batch_dir=str(tmp_path / "batch")) as served,
    ):
        yield served


def _form(boundary: bytes, fields: list[tuple[str, bytes]], file: bytes = b"{}\n") -> bytes:
    parts = [
        b'--%s\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s\r\n' % (boundary, name.encode(), value)
        for name, value in fields
    ]
    parts.append(
        b'--%s\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        b"Content-Type: application/jsonl\r\n\r\n%s\r\n--%s--\r\n" % (boundary, file, boundary)
    )
    return b"".join(parts)


async def test_an_upload_keeps_only_known_small_fields(keyed_router) -> None:  # noqa: ANN001
    url, _ = keyed_router
    async with httpx.AsyncClient(base_url=url, timeout=30, headers={"authorization": "Bearer key-a"}) as http:

        async def post(body: bytes, boundary: bytes = b"b0undary") -> httpx.Response:
            headers = {"content-type": f"multipart/form-data; boundary={boundary.decode()}"}
            return await http.post("/v1/files", content=body, headers=headers)

        ok = await post(_form(b"b0undary", [("purpose", b"batch"), ("expires_after[anchor]", b"created_at")]))
        assert ok.status_code == 200, ok.text
        many = [(f"f{n}", b"v" * 4000) for n in range(2000)]  # 8 MB of fields of no known name
        unknown = await post(_form(b"b0undary", [("purpose", b"batch"), *many]))
        assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "invalid_field", unknown.text
        long_field = await post(_form(b"b0undary", [("purpose", b"batch" + b" " * 10_000)]))
        assert long_field.status_code == 400 and long_field.json()["error"]["code"] == "invalid_field"
        header = b"--b0undary\r\nX-Padding: " + b"h" * 20_000 + b"\r\n"
        long_header = await post(
            header + _form(b"b0undary", [("purpose", b"batch")])[len(b"--b0undary\r\n") :]
        )
        assert long_header.status_code == 400 and long_header.json()["error"]["code"] == "invalid_multipart"
        boundary = b"B" * 300
        odd = await post(_form(boundary, [("purpose", b"batch")]), boundary)
        assert odd.status_code == 400 and odd.json()["error"]["code"] == "invalid_content_type", odd.text


async def test_405s_name_the_allowed_methods(keyed_router) -> None:  # noqa: ANN001
    url, _ = keyed_router
    async with httpx.AsyncClient(base_url=url, timeout=30, headers={"authorization": "Bearer key-a"}) as http:
        for method, path, allow in (
            ("PUT", "/v1/files", "GET, HEAD, POST"),
            ("DELETE", "/v1/batches", "GET, HEAD, POST"),
            ("POST", "/v1/files/file-x", "GET, HEAD, DELETE"),
            ("GET", "/v1/batches/batch_x/cancel", "POST"),
            ("DELETE", "/v1/files/file-x/content", "GET, HEAD"),
        ):
            answer = await http.request(method, path)
            assert answer.status_code == 405, (method, path)
            assert answer.headers["allow"] == allow, (method, path)
            assert answer.json()["error"]["code"] == "method_not_allowed"


async def test_a_cursor_of_another_keys_object_is_not_found(keyed_router) -> None:  # noqa: ANN001
    url, _ = keyed_router
    async with (
        httpx.AsyncClient(base_url=url, timeout=30, headers={"authorization": "Bearer key-a"}) as a,
        httpx.AsyncClient(base_url=url, timeout=30, headers={"authorization": "Bearer key-b"}) as b,
    ):
        b_files = [(await upload(b, jsonl(input_lines(1, MODEL)))).json()["id"] for _ in range(3)]
        a_file = (await upload(a, jsonl(input_lines(1, MODEL)))).json()["id"]
        b_files += [(await upload(b, jsonl(input_lines(1, MODEL)))).json()["id"] for _ in range(2)]
        listed = (await b.get("/v1/files", params={"after": a_file})).json()["data"]
        assert [f["id"] for f in listed] == list(reversed(b_files))  # a's id moves nothing
        a_batch = (await create_batch(a, a_file)).json()["id"]
        b_batch = (await create_batch(b, b_files[0])).json()["id"]
        assert [x["id"] for x in (await b.get("/v1/batches", params={"after": a_batch})).json()["data"]] == [
            b_batch
        ]


async def test_the_runner_stops_when_woken_as_it_is_cancelled(tmp_path: Path) -> None:
    """The suite's hang: a runner woken (a line ended, a batch created) just as it was stopped never
    stopped, since Python 3.11's ``asyncio.wait_for`` returns normally when what it waits for completes
    in the same turn as its task's cancellation, and the loop went on with its one cancellation lost."""
    router = build_router(
        {"static_backends": "http://127.0.0.1:9", "batch_api": True, "batch_dir": str(tmp_path / "batch")}
    )
    runner = router.batch
    assert runner is not None
    await runner.start()
    work = runner._tasks[0]  # noqa: SLF001 - the runner's loop

    def waiting_for_work() -> bool:  # suspended between two rounds, on its wake-up
        chain = _awaiting(work.get_coro())
        return "_work" in chain and "_round" not in chain and "run" not in chain.rsplit("->", 1)[-1]

    await wait_for(waiting_for_work, what="the runner's loop to wait for work")
    runner.wake()
    await bounded(runner.stop(), 10, "the runner to stop after a wake-up")
    assert work.done()


def test_an_uploads_form_fits_in_what_its_stream_holds_from_the_budget() -> None:
    """An upload's memory beside its window is the piece being written and its form (known fields and one
    part's headers, each bounded): all of it is taken from the server's body budget with the stream."""
    assert files.FORM_BYTES <= body_stream.HANDLER_BYTES
    assert body_stream.STREAM_HOLD <= 2 * 1024 * 1024  # "a few MiB" at most, whatever the form holds
