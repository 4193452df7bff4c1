"""``prefixaware`` following KV events on real engines (CPU build, KV events over ZMQ with replay): the router's keys for a
request equal the keys it computes from the engines' own events, so a prompt prefilled on an engine
by someone else is found there, by two router replicas alike; an engine's cache reset empties its
entry."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.router.helpers import metric_value, running_router, wait_for
from vllm_stack.scheduling.index.blocks import salt_of, token_block_keys

pytestmark = pytest.mark.engine

MODEL = "tiny-llama"
BLOCK = 128  # the CPU build's KV block size


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are the assistant of the long shared handbook. " * 40}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t}: what does chapter {t} say? " * 8})
        messages.append({"role": "assistant", "content": f"chapter {t} says many things " * 4})
    return messages[:-1]


def picker(router):  # noqa: ANN001, ANN201
    return router._scheduling.plugins["prefix-cache-picker"]  # noqa: SLF001 - the live plugin


async def test_prefixaware_finds_prompts_prefilled_elsewhere_and_follows_cache_resets(
    engines, tiny_model_dir: Path
) -> None:
    target = engines[0]
    tokenizers = {MODEL: str(tiny_model_dir)}
    async with (
        running_router(engines.urls, routing_logic="prefixaware", tokenizers=tokenizers) as (url_a, router_a),
        running_router(engines.urls, routing_logic="prefixaware", tokenizers=tokenizers) as (url_b, router_b),
        httpx.AsyncClient(timeout=60) as h,
    ):
        routers = (router_a, router_b)
        for url in (url_a, url_b):  # ready only once it follows both engines' events (issue 50)
            deadline = asyncio.get_running_loop().time() + 20
            ready = await h.get(url + "/ready")
            while ready.status_code != 200:
                assert asyncio.get_running_loop().time() < deadline, f"not ready: {ready.json()}"
                await asyncio.sleep(0.05)  # polls the condition
                ready = await h.get(url + "/ready")
            assert ready.json()["kv_events_following"] is True
        for router in routers:
            assert router.kv_feed.following() and len(router.kv_feed._tasks) == 2  # noqa: SLF001
        for router in routers:  # subscribed to both engines (endpoints from GET /kv_event_sources)
            await wait_for(lambda r=router: len(r.kv_feed.stats) == 2, within=20, what="two KV-event streams")
        # Prefilled on the target engine directly, past both routers.
        messages = conversation(2)
        r = await h.post(
            target.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        ids = picker(router_a).tokenizers[MODEL].chat_ids({"messages": messages})
        keys = token_block_keys(ids, BLOCK, salt_of(MODEL, None))
        assert len(keys) >= 3
        for router in routers:
            index = picker(router).index
            await wait_for(
                lambda i=index: i.match(target.address, keys) == len(keys),
                within=20,
                what="blocks from events",
            )
            state = router.scheduling_description()["state"]["prefix-cache-picker"]
            assert state["index"] == "kv_events"
            assert state["kv_events"][target.address]["orphans"] == 0
            streams = router.kv_feed.describe()[target.address]
            assert streams[0]["resets"] == 0 and streams[0]["batches"] >= 1
        # The next turn of that conversation goes to the target through either router.
        follow_up = conversation(3)
        for url, router in ((url_a, router_a), (url_b, router_b)):
            r = await h.post(
                url + "/v1/chat/completions", json={"model": MODEL, "messages": follow_up, "max_tokens": 2}
            )
            assert r.status_code == 200, r.text
            got = {
                e: metric_value(
                    router, "vllm_stack_router_requests_total", model=MODEL, engine=e, status="200"
                )
                for e in (target.address, engines[1].address)
            }
            assert got == {target.address: 1, engines[1].address: 0}, got
            reasons = [
                metric_value(
                    router, "vllm_stack_router_routing_decisions_total", strategy="prefixaware", reason=x
                )
                for x in ("prefix_partial", "prefix_hit")
            ]
            assert sum(reasons) == 1, reasons  # a match found in the index, not a spread
        # What the index predicted cached on the target, against what the engine reported
        # (usage.prompt_tokens_details.cached_tokens), within one block.
        for router in routers:
            outcomes = {
                o: metric_value(
                    router, "vllm_stack_router_prefix_predictions_total", mode="tokens", outcome=o
                )
                for o in ("exact", "over", "under", "unreported")
            }
            assert outcomes == {"exact": 1, "over": 0, "under": 0, "unreported": 0}, outcomes
        # The engine's cache is reset (AllBlocksCleared): its entry empties in both routers.
        r = await h.post(target.url + "/reset_prefix_cache")
        assert r.status_code == 200, r.text
        # An engine publishes the events of a step with that step: an idle engine's reset is seen with
        # its next request (one shorter than a block, so it stores nothing new).
        r = await h.post(
            target.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}
        )
        assert r.status_code == 200, r.text
        for router in routers:
            index = picker(router).index
            await wait_for(lambda i=index: i.blocks_of(target.address) == 0, within=20, what="cleared entry")
