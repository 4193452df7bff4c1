"""Helpers for Batch API tests: input files, waiting on a batch, reading its output and error files."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import orjson
from vllm_stack_dev.testbed.engines import free_port


def input_lines(
    count: int, model: str, url: str = "/v1/chat/completions", max_tokens: int = 4, prefix: str = "req"
) -> list[dict[str, Any]]:
    """``count`` request lines for ``url`` (custom ids ``<prefix>-<n>``)."""
    lines = []
    for n in range(count):
        if url == "/v1/chat/completions":
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"line {n}"}],
                "max_tokens": max_tokens,
            }
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


async def create_batch(
    http: httpx.AsyncClient, file_id: str, endpoint: str = "/v1/chat/completions"
) -> httpx.Response:
    return await http.post(
        "/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"}
    )


async def start_batch(http: httpx.AsyncClient, lines: list[dict[str, Any]]) -> str:
    """Upload ``lines`` and create a batch of them: its id."""
    file_id = (await upload(http, jsonl(lines))).json()["id"]
    answer = await create_batch(http, file_id, lines[0]["url"])
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


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


class RouterProcess:
    """`vllm-stack router` as its own process (in its own process group, so a SIGKILL takes it at once, as
    a node failure or the OOM killer would), with the Batch API on over ``backends``."""

    def __init__(
        self, backends: list[str], batch_dir: Path, log: Path, *args: str, database_url: str = ""
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_STACK_")}
        if database_url:
            env["VLLM_STACK_BATCH_DATABASE_URL"] = database_url
        command = [
            *router_command(),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--static-backends", ",".join(backends),
            "--routing-logic", "roundrobin",
            "--health-check-interval", "0.5",
            "--engine-scrape-interval", "0.5",
            "--batch-api",
            "--batch-dir", str(batch_dir),
            *args,
        ]  # fmt: skip
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    async def ready(self, within: float = 60.0) -> RouterProcess:
        deadline = time.monotonic() + within
        async with httpx.AsyncClient(timeout=2) as http:
            while True:
                if self.process.poll() is not None:
                    raise AssertionError(f"router exited {self.process.returncode}: {self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(self.url + "/ready")).status_code == 200:
                        return self
                if time.monotonic() > deadline:
                    raise AssertionError(f"router not ready in {within}s: {self.log_tail()}")
                await asyncio.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL: no shutdown of any kind."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._log.close()

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def router_command() -> list[str]:
    script = Path(sys.executable).parent / "vllm-stack"
    if script.exists():
        return [str(script), "router"]
    return [sys.executable, "-c", "import sys; from vllm_stack.cli import main; sys.exit(main())", "router"]
