"""Disaggregated prefill on real CPU vLLM engines (the session's ``pd_engines``): a prefill engine (ExampleConnector, kv_producer)
and a decode engine (ExampleConnector, kv_consumer) that share a KV folder, with the router between
them, and a TCP tap in front of each engine so the test reads both legs as they were on the wire.

What ExampleConnector shows and what it does not: the KV the prefill engine computed reaches the
decode engine (``vllm:external_prefix_cache_hits_total`` there), keyed by the prompt in the shared
folder. It ignores ``kv_transfer_params`` and returns none, so the hand-over protocol itself (what the
prefill answer returns goes to the decode request unchanged) is asserted on the decode engine's side
of the wire here, and with a connector's non-empty hand-over in tests/router/test_disagg.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from vllm_stack_dev.testbed.engines import (
    EngineGroup,
    EngineSpec,
    default_cpus,
    launch,
    nixl_loopback_env,
    wait_ready,
)

from tests.conftest import CHAT_MODEL, READY_TIMEOUT
from tests.fakes.wire_tap import Exchange, WireTap, tapped
from tests.router.helpers import REAL_ENGINE_HEALTH, http, metric_value, running_router
from vllm_stack.app import Router

pytestmark = pytest.mark.engine

HITS = "vllm:external_prefix_cache_hits_total"
# About 600 prompt tokens with the chat template: four of the CPU backend's 128-token KV blocks
LONG = " ".join(f"word{i} of the long document that the decode engine should not prefill" for i in range(60))


#: The router between the two engines: prefill on the first, decode on the second.
SETTINGS = {
    **REAL_ENGINE_HEALTH,
    "routing_logic": "disaggregated_prefill",
    "static_roles": "prefill,decode",
    "disagg_min_uncached_tokens": 128,
}
SENT = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 8, "stream": True}


@contextlib.asynccontextmanager
async def pd_router(engines: EngineGroup) -> AsyncIterator[tuple[str, Router, WireTap, WireTap]]:
    """The router over a tap in front of each engine: (its URL, the router, prefill tap, decode tap)."""
    prefill, decode = engines
    async with tapped(prefill.port) as prefill_tap, tapped(decode.port) as decode_tap:
        async with running_router([prefill_tap.url, decode_tap.url], **SETTINGS) as (url, router):
            yield url, router, prefill_tap, decode_tap


#: The client's wait for the answer's head: a prefill, then the decode engine's first NIXL handshake with
#: the prefill engine and its pull of the KV. 3-5 s on a quiet machine (also with four busy processes on
#: its two cores); once over 30 s in CI, beside the engine tier's other engines.
HANDOVER_TIMEOUT = 120.0


async def stream_long_prompt(c: httpx.AsyncClient) -> None:
    async with c.stream("POST", "/v1/chat/completions", json=SENT, timeout=HANDOVER_TIMEOUT) as r:
        text = (await r.aread()).decode()
    assert r.status_code == 200, text
    assert text.rstrip().endswith("data: [DONE]")


def assert_handed_over(prefill_leg: Exchange, decode_leg: Exchange) -> dict | None:
    """The prefill leg asked for a remote decode; the decode request is the client's plus exactly the
    kv_transfer_params the prefill answer returned (which this returns)."""
    prefill_request = json.loads(prefill_leg.body)
    assert prefill_request["max_tokens"] == 1 and prefill_request["stream"] is False
    assert prefill_request["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill_leg.status == 200 and prefill_leg.answer is not None
    returned = json.loads(prefill_leg.answer).get("kv_transfer_params")
    decode_request = json.loads(decode_leg.body)
    assert decode_request.get("kv_transfer_params") == returned
    assert {k: v for k, v in decode_request.items() if k != "kv_transfer_params"} == SENT
    assert prefill_leg.headers[b"x-request-id"] == decode_leg.headers[b"x-request-id"]
    return returned


async def test_the_decode_engine_takes_the_prefilled_kv_and_the_handover_as_returned(
    pd_engines: EngineGroup,
) -> None:
    decode = pd_engines[1]
    async with pd_router(pd_engines) as (url, router, prefill_tap, decode_tap):
        hits_before = decode.metric_value(HITS)
        async with http(url) as c:
            await stream_long_prompt(c)
            # a short prompt: served by the decode engine alone
            short = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            r = await c.post("/v1/chat/completions", json=short)
            assert r.status_code == 200, r.text
        hits = decode.metric_value(HITS) - hits_before
        outcomes = {
            o: metric_value(router, "vllm_stack_router_disagg_requests_total", model=CHAT_MODEL, outcome=o)
            for o in ("disaggregated", "short")
        }
    assert outcomes == {"disaggregated": 1, "short": 1}
    # the decode engine read the prompt's KV from the prefill engine's blocks (whole blocks only)
    assert hits >= 256, f"external prefix-cache hits on the decode engine: {hits}"
    (prefill_leg,) = prefill_tap.exchanges("/v1/chat/completions")
    decode_legs = decode_tap.exchanges("/v1/chat/completions")
    assert len(decode_legs) == 2
    # ExampleConnector returns no hand-over: the decode request is the client's own
    assert assert_handed_over(prefill_leg, decode_legs[0]) is None


def _nixl_spec(model_dir: Path) -> EngineSpec:
    """vLLM's NixlConnector on CPU: KV in a host buffer, NIXL over UCX on loopback TCP; each engine its
    own side-channel port, on which the decode engine asks the prefill engine for the blocks."""
    config = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    return EngineSpec(
        model_dir,
        CHAT_MODEL,
        enable_lora=False,
        kv_events=False,
        extra_args=["--kv-transfer-config", json.dumps(config)],
        env=nixl_loopback_env(),
    )


@pytest.fixture(scope="module")
def nixl_engines(
    pd_engines: EngineGroup, tiny_model_dir: Path, engine_logs_dir: Path
) -> Iterator[EngineGroup]:
    """Two NixlConnector engines, started after the ExampleConnector pair is up and stopped with this
    module (nine engines at once would not fit these machines)."""
    cpus = default_cpus(2)
    group = EngineGroup(
        [
            launch(_nixl_spec(tiny_model_dir), name=f"nixl-{side}", cpu=cpu, log_dir=engine_logs_dir)
            for side, cpu in zip(("prefill", "decode"), cpus, strict=True)
        ]
    )
    try:
        wait_ready(group.engines, READY_TIMEOUT)
        yield group
    finally:
        group.stop()


async def test_nixl_hands_the_kv_over_with_the_prefill_answers_params(nixl_engines: EngineGroup) -> None:
    """The same flow with NixlConnector, the connector whose protocol this is: the prefill answer
    returns the remote block ids, engine id, host and port; the decode engine, given exactly those,
    pulls the prompt's KV from the prefill engine instead of computing it."""
    decode = nixl_engines[1]
    async with pd_router(nixl_engines) as (url, _, prefill_tap, decode_tap):
        hits_before = decode.metric_value(HITS)
        prompt_tokens_before = decode.metric_value("vllm:prompt_tokens_total")
        async with http(url) as c:
            await stream_long_prompt(c)
        hits = decode.metric_value(HITS) - hits_before
        prompt_tokens = decode.metric_value("vllm:prompt_tokens_total") - prompt_tokens_before
    (prefill_leg,) = prefill_tap.exchanges("/v1/chat/completions")
    (decode_leg,) = decode_tap.exchanges("/v1/chat/completions")
    returned = assert_handed_over(prefill_leg, decode_leg)
    assert returned and returned["do_remote_prefill"] is True and returned["remote_block_ids"], returned
    # every prompt token the decode engine counted came from the prefill engine's KV
    assert hits >= 256 and hits >= prompt_tokens - 128, (hits, prompt_tokens)
