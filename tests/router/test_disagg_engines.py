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

import json

import pytest
from vllm_stack_dev.testbed.engines import EngineGroup

from tests.conftest import CHAT_MODEL
from tests.fakes.wire_tap import tapped
from tests.router.helpers import http, metric_value, running_router

pytestmark = pytest.mark.engine

HITS = "vllm:external_prefix_cache_hits_total"
# About 600 prompt tokens with the chat template: four of the CPU backend's 128-token KV blocks
LONG = " ".join(f"word{i} of the long document that the decode engine should not prefill" for i in range(60))


async def test_the_decode_engine_takes_the_prefilled_kv_and_the_handover_as_returned(
    pd_engines: EngineGroup,
) -> None:
    prefill, decode = pd_engines
    async with tapped(prefill.port) as prefill_tap, tapped(decode.port) as decode_tap:
        settings = {
            "routing_logic": "disaggregated_prefill",
            "static_roles": "prefill,decode",
            "disagg_min_uncached_tokens": 128,
        }
        async with running_router([prefill_tap.url, decode_tap.url], **settings) as (url, router):
            hits_before = decode.metric_value(HITS)
            sent = {
                "model": CHAT_MODEL,
                "messages": [{"role": "user", "content": LONG}],
                "max_tokens": 8,
                "stream": True,
            }
            async with http(url) as c:
                async with c.stream("POST", "/v1/chat/completions", json=sent) as r:
                    text = (await r.aread()).decode()
                assert r.status_code == 200, text
                assert text.rstrip().endswith("data: [DONE]")
                # a short prompt: served by the decode engine alone
                short = await c.post(
                    "/v1/chat/completions",
                    json={
                        "model": CHAT_MODEL,
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 2,
                    },
                )
                assert short.status_code == 200, short.text
            hits = decode.metric_value(HITS) - hits_before
            outcomes = {
                o: metric_value(
                    router, "vllm_stack_router_disagg_requests_total", model=CHAT_MODEL, outcome=o
                )
                for o in ("disaggregated", "short")
            }
    assert outcomes == {"disaggregated": 1, "short": 1}
    # the decode engine read the prompt's KV from the prefill engine's blocks (whole blocks only)
    assert hits >= 256, f"external prefix-cache hits on the decode engine: {hits}"
    (prefill_leg,) = prefill_tap.exchanges("/v1/chat/completions")
    decode_legs = decode_tap.exchanges("/v1/chat/completions")
    assert len(decode_legs) == 2
    prefill_request = json.loads(prefill_leg.body)
    assert prefill_request["max_tokens"] == 1 and prefill_request["stream"] is False
    assert prefill_request["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill_leg.status == 200 and prefill_leg.answer is not None
    returned = json.loads(prefill_leg.answer).get("kv_transfer_params")
    decode_request = json.loads(decode_legs[0].body)
    # exactly what the prefill answer returned (ExampleConnector: none, so the client's own request)
    assert decode_request.get("kv_transfer_params") == returned
    assert {k: v for k, v in decode_request.items() if k != "kv_transfer_params"} == sent
    assert prefill_leg.headers[b"x-request-id"] == decode_legs[0].headers[b"x-request-id"]
