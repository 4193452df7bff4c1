"""Eviction against a real vLLM engine: the engine's request is aborted (its running slot freed) when
the router closes the evicted request's connection, the evicted stream ends with the error event, the
critical request that waited is served, and only one sheddable request goes.

The engine runs two sequences at once (``--max-num-seqs 2``): two long sheddable streams fill it, a
critical stream then waits in its queue. This module starts its own engine (one, for the module) so
that running it alone does not start the session's five.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from vllm_stack_dev.testbed.engines import Engine, EngineSpec, default_cpus, launch, wait_ready

from tests.conftest import READY_TIMEOUT
from tests.router.helpers import metric_value, running_router, wait_for

pytestmark = pytest.mark.engine

MODEL = "tiny-llama"
HELD_TOKENS = 3000  # longer than the test needs them to run (max_model_len 4096)


@pytest.fixture(scope="module")
def two_slot_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    spec = EngineSpec(tiny_model_dir, MODEL, kv_events=False, enable_lora=False, max_model_len=4096,
                      extra_args=["--max-num-seqs", "2"])  # fmt: skip
    engine = launch(
        spec, name="eviction", cpu=default_cpus(1)[0], log_dir=tmp_path_factory.mktemp("eviction")
    )
    try:
        wait_ready([engine], READY_TIMEOUT)
        yield engine
    finally:
        engine.stop()


def chat(max_tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell a story."}],
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,  # random weights may stop at once: each request does its work
        "stream": True,
    }


async def test_a_critical_request_that_waits_evicts_one_sheddable_stream(two_slot_engine: Engine) -> None:
    settings = {"eviction_enabled": True, "eviction_after": 1.0, "routing_logic": "leastloaded"}
    environ = {"VLLM_STACK_PRIORITY_API_KEYS": "k"}
    async with running_router([two_slot_engine.url], environ=environ, **settings) as (url, router):
        engine = router.registry.engines()[0]
        async with httpx.AsyncClient(base_url=url, timeout=180) as h:
            lines: dict[str, list[str]] = {"old": [], "young": []}

            async def sheddable(name: str) -> None:
                headers = {"x-request-priority": "sheddable"}
                async with h.stream(
                    "POST", "/v1/chat/completions", json=chat(HELD_TOKENS), headers=headers
                ) as r:
                    async for line in r.aiter_lines():
                        if line:
                            lines[name].append(line)

            old = asyncio.create_task(sheddable("old"))
            await wait_for(lambda: len(lines["old"]) >= 2, 60, "the first sheddable stream under way")
            young = asyncio.create_task(sheddable("young"))
            await wait_for(lambda: len(lines["young"]) >= 2, 60, "the second sheddable stream under way")
            await wait_for(
                lambda: two_slot_engine.metric_value("vllm:num_requests_running") == 2, 30, "both slots taken"
            )
            critical = {"x-request-priority": "critical", "authorization": "Bearer k"}
            r = await h.post("/v1/chat/completions", json=chat(8), headers=critical)
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            await asyncio.wait_for(young, 30)
            error = json.loads(lines["young"][-1].removeprefix("data: "))["error"]
            assert error["code"] == "evicted"
            assert "data: [DONE]" not in lines["young"]
            # the engine aborted the evicted request: one running (the older stream), none waiting
            await wait_for(
                lambda: (
                    two_slot_engine.metric_value("vllm:num_requests_running") == 1
                    and two_slot_engine.metric_value("vllm:num_requests_waiting") == 0
                ),
                30,
                "the engine running only the older sheddable stream",
            )
            assert not old.done() and engine.in_flight == 1
            assert (
                metric_value(
                    router, "vllm_stack_router_tenant_rejections_total", tenant="default", reason="evicted"
                )
                == 1
            )
            old.cancel()
            await asyncio.gather(old, return_exceptions=True)
