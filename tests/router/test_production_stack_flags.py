"""production-stack's 2026 router flags (issue 52 item 3), each given on the command line as a
production-stack user writes it and checked through a running router: what the flag parses to, and
what the router then does differently (with the flag against without it).

Stub engines stand in for vLLM: these tests need engines that fail on demand and that report which
requests they were sent (tests/fakes/stub_engine.py)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from vllm_stack_dev.testbed.engines import port_for_later

from tests.batch.helpers import input_lines, jsonl, wait_batch
from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import http, running_router, stubs, wait_for
from vllm_stack import log_format
from vllm_stack.app import build_router
from vllm_stack.config import DECLARED, ConfigError
from vllm_stack.router_cli import build_parser
from vllm_stack.settings.server import LOG_FORMATS

MSG = [{"role": "user", "content": "hi"}]
BODY = {"model": "stub-model", "messages": MSG, "max_tokens": 3}


def flags(*argv: str) -> dict[str, Any]:
    """The settings ``vllm-stack router ARGV`` gives (what the command line passes the router)."""
    args = vars(build_parser().parse_args(list(argv)))
    return {
        k: v for k, v in args.items() if v is not None and k != "config_file" and not k.startswith("hosted_")
    }


def route(r: Any) -> dict[str, str]:  # noqa: ANN401 - an httpx response
    """The x-vllm-stack-route header (debug headers on) as a mapping."""
    parts = [p.strip().split("=", 1) for p in r.headers["x-vllm-stack-route"].split(";")]
    return {k: v for k, v in parts}


# ---- --max-instance-failover-reroute-attempts: our retries -------------------------------------------


def test_reroute_attempts_is_the_retries_setting() -> None:
    assert flags("--max-instance-failover-reroute-attempts", "0") == {"retries": 0}
    assert flags("--max-instance-failover-reroute-attempts", "3")["retries"] == 3


async def _codes_with_one_failing_engine(*argv: str) -> list[int]:
    """Two round-robin requests over two engines whose first answers 503 once."""
    a, b = StubEngine("a", ["stub-model"]), StubEngine("b", ["stub-model"])
    a.behaviour.fail_statuses = [503]
    settings = flags("--routing-logic", "roundrobin", *argv)
    async with stubs(a, b) as urls, running_router(urls, **settings) as (url, _), http(url) as h:
        return [(await h.post("/v1/chat/completions", json=BODY)).status_code for _ in range(2)]


async def test_reroute_attempts_reroute_a_failed_request_to_another_engine() -> None:
    # production-stack's default, 0: the engine's 503 reaches the client
    assert 503 in await _codes_with_one_failing_engine("--max-instance-failover-reroute-attempts", "0")
    # 1: the failed attempt goes to the other engine
    assert await _codes_with_one_failing_engine("--max-instance-failover-reroute-attempts", "1") == [200, 200]


# ---- --prefix-min-match-length: the prefix-cache picker's minimum match ----------------------------------


def test_prefix_min_match_length_parses_in_characters() -> None:
    assert flags("--prefix-min-match-length", "4096") == {"prefix_min_match_length": 4096}


async def _second_reason(*argv: str) -> str:
    """The prefix picker's reason for the second of two equal long prompts."""
    prompt = [{"role": "user", "content": "the same long question about the handbook " * 40}]
    body = {"model": "stub-model", "messages": prompt, "max_tokens": 3}
    settings = flags("--routing-logic", "prefixaware", "--debug-headers", *argv)
    engines = StubEngine("a", ["stub-model"]), StubEngine("b", ["stub-model"])
    async with stubs(*engines) as urls, running_router(urls, **settings) as (url, _), http(url) as h:
        first = await h.post("/v1/chat/completions", json=body)
        assert route(first)["reason"] == "prefix_miss"
        return route(await h.post("/v1/chat/completions", json=body))["reason"]


async def test_a_match_shorter_than_the_minimum_is_placed_as_a_new_prefix() -> None:
    assert await _second_reason() == "prefix_hit"
    # the prompt's ~1,800 characters are all cached on one engine; a minimum above that ignores the match
    assert await _second_reason("--prefix-min-match-length", "100000") == "prefix_spread"
    assert await _second_reason("--prefix-min-match-length", "128") == "prefix_hit"


# ---- --log-format json ------------------------------------------------------------------------------

SECRET = "sk-never-in-a-log-line"


def test_log_format_parses_and_names_the_formatters_values() -> None:
    assert flags("--log-format", "json") == {"log_format": "json"}
    assert DECLARED["log_format"].default == "text"
    assert LOG_FORMATS == log_format.LOG_FORMATS  # declared twice: settings imports no formatter


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


async def _router_process(port: int, backend: str, keys: Path, *argv: str) -> asyncio.subprocess.Process:
    """``vllm-stack router`` as its own process (the log format is set up process-wide), once /health
    answers."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "vllm_stack.router_cli", "--port", str(port), "--host", "127.0.0.1",
        "--static-backends", backend, "--api-keys-file", str(keys), *argv,
        stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient() as h:
        while True:
            try:
                if (await h.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                    return proc
            except httpx.TransportError:
                pass
            if proc.returncode is not None or time.monotonic() > deadline:
                raise AssertionError("timed out waiting for the router process's /health")
            await asyncio.sleep(0.05)


async def _logged(tmp_path: Path, *argv: str) -> str:
    """What a router process given ``argv`` writes to stderr for one chat completion with a request id
    and a client key."""
    keys = tmp_path / "keys"
    keys.write_text(SECRET + "\n")
    port = port_for_later()
    async with stubs(StubEngine("a", ["stub-model"])) as urls:
        proc = await _router_process(port, urls[0], keys, "--access-log", *argv)
        try:
            headers = {"authorization": f"Bearer {SECRET}", "x-request-id": "req-json-1"}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as h:
                r = await h.post("/v1/chat/completions", json=BODY, headers=headers)
            assert r.status_code == 200
        finally:
            proc.terminate()
            _, err = await asyncio.wait_for(proc.communicate(), 30)
    return err.decode()


async def test_json_log_lines_carry_the_request_id_and_no_key(tmp_path) -> None:
    text = await _logged(tmp_path, "--log-format", "json")
    lines = _json_lines(text)
    assert lines and len(lines) == len(text.strip().splitlines())  # every line one JSON object
    access = [line for line in lines if line.get("request_id") == "req-json-1"]
    assert len(access) == 1, lines
    assert access[0]["level"] == "INFO" and "/v1/chat/completions -> 200" in access[0]["message"]
    assert {"timestamp", "logger", "filename", "lineno"} <= set(access[0])
    assert SECRET not in text
    # text, the default: no JSON, and the key no more there
    plain = await _logged(tmp_path)
    assert "/v1/chat/completions -> 200" in plain and not _json_lines(plain) and SECRET not in plain


def test_json_lines_carry_the_trace_id_and_exceptions() -> None:
    record = logging.LogRecord("vllm_stack.x", logging.ERROR, "f.py", 7, "failed %s", ("here",), None)
    record.__dict__.update(request_id="r1", trace_id="0af7651916cd43dd8448eb211c80319c")
    try:
        raise ValueError("boom")
    except ValueError:
        record.exc_info = sys.exc_info()
    line = json.loads(log_format.formatter("json").format(record))
    assert line["message"] == "failed here" and line["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert line["request_id"] == "r1" and "ValueError: boom" in line["exception"]


# ---- --routing-logic priority -------------------------------------------------------------------------


def test_priority_logic_and_its_settings_parse() -> None:
    given = flags("--routing-logic", "priority", "--priority-threshold", "2", "--priority-default", "5")
    assert given == {"routing_logic": "priority", "priority_threshold": 2, "priority_default": 5}


async def _profiles(requests: list[tuple[dict[str, str], dict[str, Any]]], *argv: str) -> list[str]:
    """The profile each request (headers, body fields) ran, through a router of ``--routing-logic
    priority`` and ``argv`` over two engines; RAISER may raise a priority."""
    settings = flags("--routing-logic", "priority", "--debug-headers", *argv)
    engines = StubEngine("a", ["stub-model"]), StubEngine("b", ["stub-model"])
    environ = {"VLLM_STACK_PRIORITY_API_KEYS": RAISER}
    out = []
    async with stubs(*engines) as urls, running_router(urls, environ, **settings) as (url, _), http(url) as h:
        for headers, fields in requests:
            r = await h.post("/v1/chat/completions", json={**BODY, **fields}, headers=headers)
            assert r.status_code == 200, r.text
            out.append(route(r)["profile"])
    return out


RAISER = "sk-may-raise"
URGENT, REST = "priority-least-loaded", "priority-round-robin"


async def test_priority_at_or_below_the_threshold_goes_least_loaded_above_round_robin() -> None:
    key = {"authorization": f"Bearer {RAISER}"}
    requests = [
        ({}, {}),  # none named: the default, 0, is at the threshold 0
        ({}, {"priority": 3}),  # vLLM's body field: 3 is less urgent than 0
        ({**key, "x-request-priority": "critical"}, {}),  # the header first: above standard
        ({**key}, {"priority": -2}),  # more urgent than 0 (a rise: the key may)
        ({"x-request-priority": "sheddable"}, {"priority": -2}),  # the header wins over the body
    ]
    assert await _profiles(requests) == [URGENT, REST, URGENT, URGENT, REST]
    # the threshold and the default as given
    assert await _profiles(requests[:2], "--priority-threshold", "3") == [URGENT, URGENT]
    assert await _profiles(requests[:1], "--priority-default", "1") == [REST]


async def test_priority_logic_sends_urgent_requests_to_the_least_loaded_engine() -> None:
    """While one engine holds a stream, every urgent request goes to the other one; requests above the
    threshold keep alternating between both."""
    engines = StubEngine("a", ["stub-model"]), StubEngine("b", ["stub-model"])
    for e in engines:
        e.behaviour.token_delay_s = 120.0  # a stream holds until its client leaves (plain answers: at once)
    settings = flags("--routing-logic", "priority", "--debug-headers")
    sheddable = {"x-request-priority": "sheddable"}
    stream = {**BODY, "stream": True}
    async with stubs(*engines) as urls, running_router(urls, **settings) as (url, router), http(url) as h:
        held = asyncio.ensure_future(h.post("/v1/chat/completions", json=stream, headers=sheddable))
        try:
            await wait_for(
                lambda: any(e.in_flight for e in router.registry.engines()), what="the stream in flight"
            )
            busy = next(e.name for e in router.registry.engines() if e.in_flight)
            urgent = [route(await h.post("/v1/chat/completions", json=BODY))["engine"] for _ in range(3)]
            rest = [
                route(await h.post("/v1/chat/completions", json=BODY, headers=sheddable))["engine"]
                for _ in range(2)
            ]
        finally:
            held.cancel()
    assert busy not in urgent and len(set(urgent)) == 1
    assert busy in rest and len(set(rest)) == 2


# ---- --root-path -------------------------------------------------------------------------------------


def test_root_path_parses_and_must_be_a_path_prefix() -> None:
    assert flags("--root-path", "/vllm") == {"root_path": "/vllm"}
    for bad in ("vllm", "vllm/", "/a?b"):
        with pytest.raises(ConfigError, match="root_path"):
            build_router({"root_path": bad, "static_backends": "http://127.0.0.1:1"}, environ={})
    # a trailing slash is taken away (the server strips the prefix only when a "/" follows it)
    for given, served in (("/vllm/", "/vllm"), ("/vllm//", "/vllm"), ("/", "")):
        router = build_router({"root_path": given, "static_backends": "http://127.0.0.1:1"}, environ={})
        assert router.root_path == served
    # a prefix of the router's own paths would take their first segment away
    with pytest.raises(ConfigError, match="/v1"):
        build_router({"root_path": "/v1", "static_backends": "http://127.0.0.1:1"}, environ={})


async def test_every_route_is_served_under_the_root_path_and_at_its_plain_path(tmp_path) -> None:
    """An OpenAI client whose base URL has the prefix (an ingress that keeps it), the probes, /metrics
    and the Batch API; the same paths without it (an ingress that strips it, as production-stack's
    router expects, and the kubelet's probes)."""
    engines = StubEngine("a", ["stub-model"]), StubEngine("b", ["stub-model"])
    settings = flags("--root-path", "/vllm", "--batch-api", "--batch-dir", str(tmp_path / "batch"))
    async with stubs(*engines) as urls, running_router(urls, **settings) as (url, _):
        sdk = openai.AsyncOpenAI(base_url=url + "/vllm/v1", api_key="none", max_retries=0, timeout=30)
        assert [m.id for m in (await sdk.models.list()).data] == ["stub-model"]
        done = await sdk.chat.completions.create(model="stub-model", messages=MSG, max_tokens=3)
        assert done.choices[0].message.content == "tok " * 3
        stream = await sdk.chat.completions.create(
            model="stub-model", messages=MSG, max_tokens=2, stream=True
        )
        assert [c.choices[0].delta.content async for c in stream] == ["t0 ", "t1 "]
        # the engines were sent the plain path
        paths = {s.path for e in engines for s in e.seen if s.method == "POST"}
        assert paths == {"/v1/chat/completions"}
        # the Batch API: a file, a batch of it, its output
        content = jsonl(input_lines(3, "stub-model"))
        created = await sdk.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
        batch = await sdk.batches.create(
            input_file_id=created.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        async with httpx.AsyncClient(base_url=url + "/vllm", timeout=30) as h:
            finished = await wait_batch(h, batch.id, {"completed", "failed"})
            assert finished["status"] == "completed", finished
            output = (await sdk.files.content(finished["output_file_id"])).content
            assert len(output.splitlines()) == 3
            for path in ("/health", "/ready", "/metrics", "/v1/models", f"/v1/batches/{batch.id}"):
                assert (await h.get(path)).status_code == 200, path
            assert "vllm_stack_router_" in (await h.get("/metrics")).text
        async with httpx.AsyncClient(base_url=url, timeout=30) as h:
            for path in ("/health", "/ready", "/metrics", "/v1/models", f"/v1/files/{created.id}"):
                assert (await h.get(path)).status_code == 200, path
            assert (await h.post("/v1/chat/completions", json=BODY)).status_code == 200
            # only the prefix as a whole path segment is taken off
            missing = await h.get("/vllm2/v1/models")
            assert missing.status_code == 404 and missing.json()["error"]["type"]
            assert (await h.get("/vllm/v1/models?x=1")).status_code == 200
