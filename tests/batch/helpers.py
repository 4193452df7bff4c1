"""Helpers for Batch API tests: input files, waiting on a batch, reading its output and error files."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

import httpx
import orjson


def input_lines(
    count: int, model: str, url: str = "/v1/chat/completions", max_tokens: int = 4, prefix: str = "req"
) -> list[dict[str, Any]]:
    """``count`` request lines for ``url`` (custom ids ``<prefix>-<n>``)."""
    lines = []
    for n in range(count):
        if url == "/v1/chat/completions":
            body = {"model": model, "messages": [{"role": "user", "content": f"line {n}"}], "max_tokens": max_tokens}
        elif url == "/v1/completions":
            body = {"model": model, "prompt": f"line {n}", "max_tokens": max_tokens}
        else:
            body = {"model": model, "input": f"line {n}"}
        lines.append({"custom_id": f"{prefix}-{n}", "method": "POST", "url": url, "body": body})
    return lines


def jsonl(lines: Iterable[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else orjson.dumps(line)) + b"\n" for line in lines)


async def upload(http: httpx.AsyncClient, content: bytes, purpose: str = "batch") -> httpx.Response:
    return await http.post(
        "/v1/files", files={"file": ("input.jsonl", content, "application/jsonl")}, data={"purpose": purpose}
    )


async def wait_batch(
    http: httpx.AsyncClient, batch_id: str, statuses: Iterable[str], within: float = 60.0
) -> dict[str, Any]:
    """The batch once its status is one of ``statuses``."""
    wanted = set(statuses)
    deadline = time.monotonic() + within
    while True:
        batch = (await http.get(f"/v1/batches/{batch_id}")).json()
        if batch["status"] in wanted:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} is {batch['status']}, not {sorted(wanted)}: {batch}")
        await asyncio.sleep(0.05)


async def file_lines(http: httpx.AsyncClient, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    response = await http.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200, response.text
    return [orjson.loads(line) for line in response.content.splitlines() if line.strip()]
