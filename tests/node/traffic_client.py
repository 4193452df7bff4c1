"""Steady traffic through the router, run as its own process inside the node's network namespace (where the
Services' ClusterIPs and CoreDNS are reachable); started and read by tests/node/traffic.py.

``--concurrency`` workers share one HTTP client (httpx, as the OpenAI SDK uses it: a pool of keep-alive
connections, no retries) and send chat completions back to back, each worker alternating plain and
streamed ones; ``--fresh`` more workers do the same on a new connection for every request (as curl or a
client without a pool does: each one resolved and connected through the Service anew). Every request is
one JSON line in ``--out`` when it ends: start, first byte and end (``time.time()``, so the test can place
them among its own steps), status, and whether it is *complete*: a 200 whose answer ends as a whole
generation does (``finish_reason`` "length" and ``completion_tokens`` equal to the ``max_tokens`` asked,
with ``ignore_eos`` so a real vLLM engine generates them all; a stream also ``data: [DONE]`` after content
chunks (a real engine may send fewer chunks than tokens), no error event). Anything else is a failure, with
the error's text. Nothing here knows what kind of engine answers.

Stopping: the test creates ``--stop-file``; no new request starts, the ones under way finish (each is
bounded by ``--request-timeout``), the process writes a last line ``{"summary": ...}`` and exits 0. It
also stops after ``--max-seconds``, and dies with the process that started it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import signal
import time
from pathlib import Path
from typing import IO, Any

import httpx

_PR_SET_PDEATHSIG = 1
FAILURE_PAUSE = 0.2  # seconds a worker waits after a failed request


def _die_with_parent() -> None:
    """Killed when the nsenter that started us dies (a test killed hard leaves no client behind)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _body(model: str, stream: bool, tokens: int, n: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": f"request {n}: count slowly"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _complete_plain(doc: dict[str, Any], tokens: int) -> str | None:
    """None when the answer is a whole generation, else what is wrong with it."""
    choices = doc.get("choices") or []
    if not choices or choices[0].get("finish_reason") != "length":
        return f"finish_reason {choices[0].get('finish_reason') if choices else None!r}, not 'length'"
    got = (doc.get("usage") or {}).get("completion_tokens")
    return None if got == tokens else f"completion_tokens {got}, asked {tokens}"


def _engine(response: httpx.Response) -> str | None:
    """Which engine answered, where the answer tells: a stub engine's own header, else the router's
    `x-vllm-stack-route` (with its debug headers on), which names the engine."""
    return response.headers.get("x-stub-engine") or response.headers.get("x-vllm-stack-route")


class Worker:
    def __init__(
        self, args: argparse.Namespace, client: httpx.AsyncClient, index: int, out: IO[str], connection: str
    ) -> None:
        self.args = args
        self.client = client
        self.connection = connection  # "pooled" (kept alive) or "fresh" (one per request)
        self.index = index
        self.out = out
        self.sent = 0

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            stream = (self.sent + self.index) % 2 == 1
            self.sent += 1
            record = await self.one(stream)
            self.out.write(json.dumps(record) + "\n")
            self.out.flush()
            # After a failure a short wait: a route that fails at once must not become a flood of records
            pause = self.args.pause if record["ok"] else max(self.args.pause, FAILURE_PAUSE)
            if pause:
                await asyncio.sleep(pause)

    async def one(self, stream: bool) -> dict[str, Any]:
        args = self.args
        tokens = args.stream_tokens if stream else args.plain_tokens
        n = self.index * 1_000_000 + self.sent
        record: dict[str, Any] = {"n": n, "worker": self.index, "kind": "stream" if stream else "plain",
                                  "connection": self.connection,
                                  "start": time.time(), "first_byte": None, "end": None, "status": None,
                                  "ok": False, "chunks": 0, "done": False, "error": None, "engine": None}  # fmt: skip
        url = args.url.rstrip("/") + "/v1/chat/completions"
        try:
            async with asyncio.timeout(args.request_timeout):
                if stream:
                    await self._stream(url, _body(args.model, True, tokens, n), tokens, record)
                else:
                    response = await self.client.post(url, json=_body(args.model, False, tokens, n))
                    record["first_byte"] = time.time()
                    record["status"] = response.status_code
                    record["engine"] = _engine(response)
                    if response.status_code != 200:
                        record["error"] = f"status {response.status_code}: {response.text[:300]}"
                    else:
                        record["error"] = _complete_plain(response.json(), tokens)
                        record["ok"] = record["error"] is None
        except TimeoutError:
            record["error"] = f"no complete answer within {args.request_timeout}s"
        except (httpx.HTTPError, OSError, ValueError) as error:
            record["error"] = f"{type(error).__name__}: {error}"[:400]
        record["end"] = time.time()
        return record

    async def _stream(self, url: str, body: dict[str, Any], tokens: int, record: dict[str, Any]) -> None:
        async with self.client.stream("POST", url, json=body) as response:
            record["status"] = response.status_code
            record["engine"] = _engine(response)
            if response.status_code != 200:
                record["error"] = f"status {response.status_code}: {(await response.aread())[:300]!r}"
                return
            finish, usage = None, None
            async for line in response.aiter_lines():
                if record["first_byte"] is None:
                    record["first_byte"] = time.time()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    record["done"] = True
                    continue
                if record["done"]:
                    record["error"] = "data after [DONE]"
                    return
                event = json.loads(data)
                if "error" in event:
                    record["error"] = f"error event: {json.dumps(event['error'])[:300]}"
                    return
                for choice in event.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        record["chunks"] += 1
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage") or usage
        got = (usage or {}).get("completion_tokens")
        if not record["done"]:
            record["error"] = f"the stream ended without [DONE] after {record['chunks']} chunks"
        elif finish != "length" or got != tokens or not record["chunks"]:
            # not one chunk per token: a real engine holds back a token whose text is empty or an unfinished
            # UTF-8 sequence and sends it with the next (the tiny model's random tokens do this)
            record["error"] = (
                f"finish_reason {finish!r}, completion_tokens {got}, {record['chunks']} chunks; asked {tokens}"
            )
        else:
            record["ok"] = True


async def _watch_stop(stop_file: Path, max_seconds: float, stopping: asyncio.Event) -> None:
    deadline = time.monotonic() + max_seconds
    while not stop_file.exists() and time.monotonic() < deadline:  # noqa: ASYNC110, ASYNC240 - a stat every 0.1 s
        await asyncio.sleep(0.1)
    stopping.set()


async def main(args: argparse.Namespace, out: IO[str]) -> None:
    stopping = asyncio.Event()
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    started = time.time()
    fresh = httpx.Limits(max_connections=max(args.fresh, 1), max_keepalive_connections=0)
    async with (
        httpx.AsyncClient(limits=limits, timeout=timeout) as client,
        httpx.AsyncClient(limits=fresh, timeout=timeout) as unpooled,
    ):
        workers = [Worker(args, client, i, out, "pooled") for i in range(args.concurrency)]
        workers += [Worker(args, unpooled, args.concurrency + i, out, "fresh") for i in range(args.fresh)]
        watcher = asyncio.create_task(_watch_stop(Path(args.stop_file), args.max_seconds, stopping))
        await asyncio.gather(*(w.run(stopping) for w in workers))
        await watcher
    summary = {"started": started, "stopped": time.time(), "sent": sum(w.sent for w in workers),
               "pid": os.getpid()}  # fmt: skip
    out.write(json.dumps({"summary": summary}) + "\n")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the router's base URL (a Service's name or ClusterIP)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, help="JSON lines, one per request")
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--concurrency", type=int, default=6, help="workers sharing a keep-alive pool")
    parser.add_argument("--fresh", type=int, default=0, help="workers opening a connection per request")
    parser.add_argument("--stream-tokens", type=int, default=20)
    parser.add_argument("--plain-tokens", type=int, default=5)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds a worker waits between requests")
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    _die_with_parent()
    arguments = parse()
    with Path(arguments.out).open("a") as records:
        asyncio.run(main(arguments, records))
