"""The Batch API's endpoints, as OpenAI defines them: ``/v1/files`` (upload, list, get, delete, content)
and ``/v1/batches`` (create, list, get, cancel). A client key is checked on the request's head (api.head);
an upload's body arrives as a stream (server.body_stream) and is written to disk as it comes."""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import parse_qs

import orjson

from vllm_stack.api.http import Receive, Send, read_json_object, send_json
from vllm_stack.api.state import RouterState
from vllm_stack.batch.files import Upload
from vllm_stack.batch.objects import (
    COMPLETION_WINDOWS,
    METADATA_PAIRS,
    VALIDATING,
    batch_object,
    file_object,
    new_id,
)
from vllm_stack.batch.runner import BatchRunner
from vllm_stack.errors import RouterError

MAX_CREATE_BODY = 64 * 1024  # a batch's creation request (ids, endpoint, window, metadata)


class BatchEndpoints:
    """The endpoints of one router's Batch API (``api.state.BatchEndpoints``)."""

    def __init__(self, runner: BatchRunner, router: RouterState) -> None:
        self.runner = runner
        self.router = router  # its client keys (replaced on reload) say whose objects a request sees

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await handle(self.runner, self.router.auth.owner(scope["headers"]), scope, receive, send)


async def handle(
    runner: BatchRunner, tenant: str, scope: dict[str, Any], receive: Receive, send: Send
) -> None:
    """Answer one Batch API request (the API key was checked on its head). ``tenant``: whose files and
    batches it may see (a digest of its key; with client keys, one key's objects are not another's)."""
    method = scope["method"]
    parts = scope["path"].strip("/").split("/")[1:]  # ["files", id, "content"] / ["batches", id, "cancel"]
    kind, rest = parts[0], parts[1:]
    shape = (kind, len(rest), rest[1] if len(rest) == 2 else "")
    methods = ROUTES.get(shape)
    if methods is None:
        raise RouterError(404, f"Unknown path {scope['path']}.", code="not_found")
    if method not in methods:
        allow = ", ".join(methods)
        raise RouterError(
            405,
            f"{scope['path']} takes {allow} only.",
            code="method_not_allowed",
            headers=[(b"allow", allow.encode())],
        )
    if method == "HEAD":
        method = "GET"
    query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode("latin-1")).items()}
    endpoint = methods[method]
    if endpoint in (_create_file, _create_batch):
        return await endpoint(runner, tenant, scope, receive, send)
    if not rest:
        return await endpoint(runner, tenant, query, send)
    return await endpoint(runner, tenant, rest[0], send)


def _header(scope: dict[str, Any], name: bytes) -> bytes:
    return next((v for k, v in scope["headers"] if k == name), b"")


def _limit(query: dict[str, str], default: int, most: int) -> int:
    raw = query.get("limit")
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise RouterError(400, "'limit' must be an integer.", param="limit") from None
    if not 1 <= value <= most:
        raise RouterError(400, f"'limit' must be between 1 and {most}.", param="limit")
    return value


# ---- files ----------------------------------------------------------------------------------------------------------
async def _create_file(
    runner: BatchRunner, tenant: str, scope: dict[str, Any], receive: Receive, send: Send
) -> None:
    files = runner.files
    upload = Upload(_header(scope, b"content-type"), files.temporary(), runner.settings.max_file_bytes)
    try:
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                upload.discard()
                return
            upload.feed(message.get("body", b""))
            if not message.get("more_body", False):
                break
        upload.finish()
        purpose = upload.fields.get("purpose", b"").decode("utf-8", "replace")
        if purpose != "batch":
            raise RouterError(
                400,
                f"'purpose' must be 'batch' (the only files this router keeps), got {purpose!r}.",
                param="purpose",
                code="invalid_purpose",
            )
        file_id = new_id("file")
        await asyncio.to_thread(files.publish, upload.target, file_id)  # (its sync may take a while)
    except BaseException:
        upload.discard()
        raise
    created = int(time.time())
    store = runner.store
    filename = upload.filename or "upload.jsonl"
    await store.run(store.add_file, tenant, file_id, "batch", filename, upload.size, created)
    await send_json(
        send,
        200,
        file_object(
            {
                "id": file_id,
                "purpose": "batch",
                "filename": filename,
                "bytes": upload.size,
                "created_at": created,
            }
        ),
    )


async def _get_file(runner: BatchRunner, tenant: str, file_id: str, send: Send) -> None:
    await send_json(send, 200, file_object(await _file_row(runner, tenant, file_id)))


async def _file_row(runner: BatchRunner, tenant: str, file_id: str) -> dict[str, Any]:
    row = await runner.store.run(runner.store.get_file, tenant, file_id)
    if row is None:
        raise RouterError(404, f"No such File object: {file_id}", param="file_id", code="not_found")
    return row


async def _list_files(runner: BatchRunner, tenant: str, query: dict[str, str], send: Send) -> None:
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise RouterError(400, "'order' must be 'asc' or 'desc'.", param="order")
    limit = _limit(query, 10000, 10000)
    store = runner.store
    rows = await store.run(
        store.list_files, tenant, query.get("purpose"), query.get("after"), limit + 1, order == "desc"
    )
    await send_json(send, 200, _page([file_object(r) for r in rows], limit))


def _page(data: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    shown = data[:limit]
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(data) > limit,
    }


async def _delete_file(runner: BatchRunner, tenant: str, file_id: str, send: Send) -> None:
    store = runner.store
    outcome = await store.run(store.delete_file, tenant, file_id)
    if outcome == "missing":
        raise RouterError(404, f"No such File object: {file_id}", param="file_id", code="not_found")
    if outcome == "in_use":
        raise RouterError(
            409,
            f"The file {file_id} is the input of a batch that has not ended; cancel the batch first.",
            param="file_id",
            code="file_in_use",
        )
    runner.files.remove(file_id)
    await send_json(send, 200, {"id": file_id, "object": "file", "deleted": True})


async def _file_content(runner: BatchRunner, tenant: str, file_id: str, send: Send) -> None:
    row = await _file_row(runner, tenant, file_id)
    files = runner.files
    if files.size(file_id) is None:
        raise RouterError(404, f"The contents of {file_id} are gone.", param="file_id", code="not_found")
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (
                    b"content-type",
                    b"application/jsonl"
                    if row["filename"].endswith(".jsonl")
                    else b"application/octet-stream",
                ),
                (b"content-length", str(files.size(file_id)).encode()),
            ],
        }
    )
    async for chunk in files.chunks(file_id):
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


# ---- batches -----------------------------------------------------------------------------------------------------------
async def _create_batch(
    runner: BatchRunner, tenant: str, scope: dict[str, Any], receive: Receive, send: Send
) -> None:
    doc = await read_json_object(receive, MAX_CREATE_BODY, scope["headers"])
    if doc is None:
        return
    endpoint = doc.get("endpoint")
    batchable = runner.router.endpoints.batchable  # the router's endpoint table says which
    if endpoint not in batchable:
        raise RouterError(
            400, f"'endpoint' must be one of {', '.join(batchable)}, got {endpoint!r}.", param="endpoint"
        )
    window = doc.get("completion_window")
    if window not in COMPLETION_WINDOWS:
        raise RouterError(
            400, f"'completion_window' must be '24h', got {window!r}.", param="completion_window"
        )
    metadata = _metadata(doc.get("metadata"))
    file_id = doc.get("input_file_id")
    if not isinstance(file_id, str):
        raise RouterError(400, "'input_file_id' must be a file id.", param="input_file_id")
    row = await runner.store.run(runner.store.get_file, tenant, file_id)
    if row is None:
        raise RouterError(404, f"No such File object: {file_id}", param="input_file_id", code="not_found")
    if row["purpose"] != "batch":
        raise RouterError(
            400, f"The file {file_id} was not uploaded with purpose 'batch'.", param="input_file_id"
        )
    now = int(time.time())
    batch = {
        "id": new_id("batch"),
        "endpoint": endpoint,
        "input_file_id": file_id,
        "completion_window": window,
        "status": VALIDATING,
        "created_at": now,
        "expires_at": now + int(runner.settings.completion_window),
        "metadata": orjson.dumps(metadata).decode() if metadata is not None else None,
        "tenant": tenant,
    }
    store = runner.store
    await store.run(store.add_batch, batch)
    runner.wake()
    await send_json(send, 200, batch_object(await store.run(store.get_batch, tenant, batch["id"])))


def _metadata(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > METADATA_PAIRS
        or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in value.items()
        )
    ):
        raise RouterError(
            400,
            f"'metadata' must map at most {METADATA_PAIRS} keys (64 characters) to strings (512 characters).",
            param="metadata",
        )
    return value


async def _get_batch(runner: BatchRunner, tenant: str, batch_id: str, send: Send) -> None:
    row = await runner.store.run(runner.store.get_batch, tenant, batch_id)
    if row is None:
        raise RouterError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
    await send_json(send, 200, batch_object(row))


async def _list_batches(runner: BatchRunner, tenant: str, query: dict[str, str], send: Send) -> None:
    limit = _limit(query, 20, 100)
    rows = await runner.store.run(runner.store.list_batches, tenant, query.get("after"), limit + 1)
    await send_json(send, 200, _page([batch_object(r) for r in rows], limit))


async def _cancel_batch(runner: BatchRunner, tenant: str, batch_id: str, send: Send) -> None:
    store = runner.store
    row = await store.run(store.cancel_batch, tenant, batch_id, int(time.time()))
    if row is None:
        raise RouterError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
    if row["status"] not in ("cancelling", "cancelled"):
        raise RouterError(
            409,
            f"A batch in status '{row['status']}' cannot be cancelled.",
            param="batch_id",
            code="invalid_status",
        )
    runner.abandon_batch(batch_id)
    runner.wake()
    await send_json(send, 200, batch_object(row))


#: Each path's shape (``files`` or ``batches``, how many parts follow, the last one's name when two) and the
#: methods it takes (HEAD wherever GET is); 405 answers list them in ``Allow``.
ROUTES: dict[tuple[str, int, str], dict[str, Any]] = {
    ("files", 0, ""): {"GET": _list_files, "HEAD": _list_files, "POST": _create_file},
    ("files", 1, ""): {"GET": _get_file, "HEAD": _get_file, "DELETE": _delete_file},
    ("files", 2, "content"): {"GET": _file_content, "HEAD": _file_content},
    ("batches", 0, ""): {"GET": _list_batches, "HEAD": _list_batches, "POST": _create_batch},
    ("batches", 1, ""): {"GET": _get_batch, "HEAD": _get_batch},
    ("batches", 2, "cancel"): {"POST": _cancel_batch},
}
