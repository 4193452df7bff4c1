"""A router killed mid-batch (SIGKILL: no shutdown at all) and started again on the same batch directory
resumes the batch: every input line ends in the output or the error file exactly once, and a line that was
in flight at the kill is sent again once, after its lease ran out."""

from __future__ import annotations

import collections
from pathlib import Path

import httpx
import orjson

from tests.batch.helpers import (
    RouterProcess,
    create_batch,
    file_lines,
    input_lines,
    jsonl,
    upload,
    wait_batch,
)
from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import stubs, wait_for

MODEL = "stub-model"
LINES = 60
CONCURRENCY = 4


def sends_per_line(engines: list[StubEngine]) -> collections.Counter[str]:
    """How many times each line reached an engine (its prompt names it)."""
    sent: collections.Counter[str] = collections.Counter()
    for engine in engines:
        for seen in engine.seen:
            if seen.path == "/v1/chat/completions":
                sent[orjson.loads(seen.body)["messages"][0]["content"]] += 1
    return sent


async def test_a_router_killed_mid_batch_resumes_it_each_line_once(tmp_path: Path) -> None:
    engines = [StubEngine("s1", [MODEL]), StubEngine("s2", [MODEL])]
    for engine in engines:
        engine.behaviour.delay_s = 0.15
    args = ("--batch-lease-seconds", "2", "--batch-concurrency", str(CONCURRENCY))
    async with stubs(*engines) as urls:
        first = RouterProcess(urls, tmp_path / "batch", tmp_path / "router.log", *args)
        second = None
        try:
            await first.ready()
            async with httpx.AsyncClient(base_url=first.url, timeout=30) as http:
                file_id = (await upload(http, jsonl(input_lines(LINES, MODEL)))).json()["id"]
                batch_id = (await create_batch(http, file_id)).json()["id"]
                await wait_for(lambda: sum(e.completed for e in engines) >= 15, within=30, what="15 answered")
            for engine in engines:  # what is sent from now on stays in flight until the kill
                engine.behaviour.delay_s = 5
            answered = sum(e.completed for e in engines)
            await wait_for(lambda: sum(sends_per_line(engines).values()) > answered, what="a line in flight")
            first.kill()
            in_flight = sum(sends_per_line(engines).values()) - sum(e.completed for e in engines)
            assert 1 <= in_flight <= CONCURRENCY and sum(e.completed for e in engines) < LINES
            for engine in engines:
                engine.behaviour.delay_s = 0.15
            second = RouterProcess(urls, tmp_path / "batch", tmp_path / "router.log", *args)
            await second.ready()
            async with httpx.AsyncClient(base_url=second.url, timeout=30) as http:
                done = await wait_batch(http, batch_id, {"completed"}, within=60)
                output = await file_lines(http, done["output_file_id"])
                errors = await file_lines(http, done["error_file_id"])
        finally:
            first.stop()
            if second is not None:
                second.stop()
    assert not errors
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{n}" for n in range(LINES))
    assert all(line["response"]["status_code"] == 200 for line in output)
    assert done["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    sent = sends_per_line(engines)
    assert set(sent) == {f"line {n}" for n in range(LINES)}
    resent = [line for line, count in sent.items() if count > 1]
    assert all(count <= 2 for count in sent.values()), sent  # re-sent once at most
    # what was in flight at the kill, and nothing else: the lines the engines had seen then, and those the
    # router had sent a moment before that reached them after it (it sends a line as its body is read, one
    # after another), at most its concurrency
    assert in_flight <= len(resent) <= CONCURRENCY, (in_flight, resent)
