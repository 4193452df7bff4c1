"""An endpoint picker that stops (a rolling upgrade's SIGTERM) while a gateway's answer is under way, and
while a gateway sends it new requests.

The picker's stream of a request lasts as long as the request's answer: the gateway tells the picker the
answer's end on it, and an Envoy gateway passes every chunk of the answer through it. So a picker that
stops refuses new streams but keeps those under way until their answers end, within its grace period (the
node tier's tests/node/test_picker_upgrade.py rolls the chart's picker under a 30 s stream). The gateway
counts each answer's end it told the picker (``told``), and each whose picker stream it found cut
(``cut``: the answer reached the client, since our gateway needs the picker only for the pick, but a
gateway that passes the answer through its picker would have failed it).

A stopping picker's gRPC server sends its connections a GOAWAY, but a stream that crosses it is refused
(CANCELLED, or INTERNAL while it is still being sent): the gateway asks again once on a new stream, which
goes on a new connection, to the picker that replaces it (here a second picker on the same port, as a
Service leads to the new Pod). Without that, 1-3 of a stop's requests under 8 clients were scheduled by
the gateway itself (fail-open) each time its connection was on the stopping picker.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import orjson
import pytest
from vllm_stack_dev.testbed.extproc_driver import exchange

from tests.fakes.stub_engine import StubBehaviour, StubEngine
from tests.router.helpers import http, metric_value, running_router, wait_for
from tests.router.test_endpoint_picker import BODY, HEADERS, picker

ENDS = "vllm_stack_router_endpoint_picker_answer_ends_total"
ASKED = "vllm_stack_router_endpoint_picker_requests_total"
TOKENS = 20  # chunks of the streamed answer, 50 ms apart: the picker stops while it is under way


def _engines() -> list[StubEngine]:
    return [StubEngine(f"e{i}", ["stub-model"], StubBehaviour(token_delay_s=0.05)) for i in range(2)]


async def _stream_through(url: str, started: asyncio.Event) -> tuple[int, bytes]:
    """A streamed completion through the gateway: its status and whole body; ``started`` set at its first
    chunk."""
    async with http(url) as h, h.stream("POST", "/v1/completions", json={**BODY, "stream": True,
                                                                         "max_tokens": TOKENS}) as r:  # fmt: skip
        body = b""
        async for chunk in r.aiter_bytes():
            body += chunk
            started.set()
        return r.status_code, body


async def _until_refused(target: str) -> None:
    """Until the picker at ``target`` refuses a new stream, 10 s at most. How gRPC says it depends on the
    moment: UNAVAILABLE (the server gone), CANCELLED (a stream that came as it began to stop), INTERNAL
    (the refusal met the client still sending)."""
    refusals = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        try:
            await exchange(target, HEADERS, orjson.dumps(BODY), stream_timeout=2)
        except grpc.aio.AioRpcError as error:
            assert error.code() in refusals, error
            return
        assert asyncio.get_running_loop().time() < deadline, "the stopping picker still takes new streams"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("grace", [30.0, 0.0], ids=["within-grace", "grace-over"])
async def test_a_stopping_picker_keeps_its_streams_to_their_answers_end_within_its_grace(
    grace: float,
) -> None:
    async with picker(_engines()) as (target, epp, _, urls):
        async with running_router(urls, endpoint_picker=f"grpc://{target}") as (url, gateway):
            started = asyncio.Event()
            request = asyncio.ensure_future(_stream_through(url, started))
            await asyncio.wait_for(started.wait(), 10)
            assert len(epp.picker_server.service.slots.open) == 1  # the request's stream, under way
            stopping = asyncio.ensure_future(epp.picker_server.stop(grace))
            if grace:  # new streams are refused at once, while the one under way goes on
                await _until_refused(target)
            status, body = await asyncio.wait_for(request, 30)
            assert status == 200 and body.rstrip().endswith(b"data: [DONE]")  # whole, either way
            assert body.count(b"data: ") == TOKENS + 1
            await asyncio.wait_for(stopping, 30)
            outcome = "told" if grace else "cut"
            await wait_for(
                lambda: metric_value(gateway, ENDS, outcome=outcome) == 1, what=f"one answer {outcome}"
            )
            assert metric_value(gateway, ENDS, outcome="cut" if grace else "told") == 0


async def test_requests_that_cross_a_stopping_pickers_goaway_are_asked_again_of_its_successor() -> None:
    async with picker(2) as (target, old, _, urls):
        port = int(target.rsplit(":", 1)[1])
        async with running_router(urls, endpoint_picker=f"grpc://{target}") as (url, gateway), http(url) as h:
            assert (await h.post("/v1/completions", json=BODY)).status_code == 200  # connected to the old one
            # its successor on the same port (SO_REUSEPORT, gRPC's default): new connections may go there
            async with running_router(urls, host="127.0.0.1", ext_proc_port=port) as (_, new):
                stop = asyncio.Event()

                async def client() -> list[int]:
                    statuses = []
                    while not stop.is_set():
                        statuses.append((await h.post("/v1/completions", json=BODY)).status_code)
                    return statuses

                clients = [asyncio.ensure_future(client()) for _ in range(8)]
                await wait_for(lambda: _picked(old) >= 20, what="traffic through the old picker")
                await old.picker_server.stop(30)
                moved = _picked(new)
                await wait_for(lambda: _picked(new) >= moved + 20, what="traffic through its successor")
                stop.set()
                statuses = [status for done in await asyncio.gather(*clients) for status in done]
            assert set(statuses) == {200}
            for outcome in ("error", "timeout"):  # none scheduled by the gateway itself
                assert metric_value(gateway, ASKED, outcome=outcome) == 0, outcome
            assert metric_value(gateway, ASKED, outcome="picked") == len(statuses) + 1


def _picked(picker_router: Any) -> float:  # noqa: ANN401 - a Router
    return metric_value(picker_router, "vllm_stack_router_ext_proc_streams_total", outcome="picked")
