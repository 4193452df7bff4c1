"""The kvaware picker (``lmcache-lookup-picker``) in the fast tier, against a stand-in for LMCache's
controller.

The real controller runs in the engine environment, so its tests are in test_kvaware.py (engine
tier). Here :class:`StandInController` answers ``POST /lookup`` as LMCache 0.5.6's controller does
(``{"layout_info": {instance: [location, tokens]}}``) with the layout a test sets, and records the
token ids it was asked about: what is under test is the router's side (its tokenizing with the
model's own tokenizer and template, the picker's threshold, which holder it takes, the fallback).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import metric_value, running_router, stubs
from vllm_stack.scheduling.index.tokens import ChatTokenizer

MODEL = "tiny-llama"
LOOKUPS = "vllm_stack_router_lmcache_lookups_total"


class StandInController:
    """Answers ``POST /lookup`` with :attr:`layout` (instance -> (location, matched tokens)); a
    stand-in for LMCache's controller, whose own process needs the engine environment."""

    def __init__(self) -> None:
        self.layout: dict[str, tuple[str, int]] = {}
        self.asked: list[list[int]] = []
        self.url = ""

    async def lookup(self, request: web.Request) -> web.Response:
        doc = await request.json()
        self.asked.append(doc["tokens"])
        layout = {instance: [location, tokens] for instance, (location, tokens) in self.layout.items()}
        return web.json_response({"layout_info": layout})


@contextlib.asynccontextmanager
async def stand_in_controller() -> AsyncIterator[StandInController]:
    controller = StandInController()
    app = web.Application()
    app.router.add_post("/lookup", controller.lookup)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    controller.url = f"http://{host}:{port}"
    try:
        yield controller
    finally:
        await runner.cleanup()


def document(topic: str) -> list[dict[str, str]]:
    """A chat whose templated prompt is several of LMCache's 256-token chunks."""
    text = " ".join(f"{topic} fact {i} is recorded in the shared document" for i in range(40))
    return [{"role": "user", "content": text}]


async def ask(url: str, topic: str) -> tuple[str, dict[str, str]]:
    """(the engine that answered, the x-vllm-stack-route header as a mapping)."""
    body = {"model": MODEL, "messages": document(topic), "max_tokens": 2}
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    parts = [p.strip().split("=", 1) for p in r.headers["x-vllm-stack-route"].split(";")]
    return r.headers["x-stub-engine"], dict(parts)


def settings(controller: StandInController, tiny_model_dir: Path, **extra: Any) -> dict[str, Any]:  # noqa: ANN401
    return {
        "routing_logic": "kvaware",
        "lmcache_controller_url": controller.url,
        "tokenizers": f"{MODEL}={tiny_model_dir}",
        "static_models": f"{MODEL},{MODEL}",
        "debug_headers": True,
        **extra,
    }


@pytest.fixture(scope="module")
def prompt_tokens(tiny_model_dir: Path) -> dict[str, int]:
    """Each topic's prompt length in the model's tokens, as the router counts them."""
    tokenizer = ChatTokenizer(tiny_model_dir)
    lengths = {t: len(list(tokenizer.chat_ids({"messages": document(t)}))) for t in ("alpha", "beta")}
    assert min(lengths.values()) > 3 * 256
    return lengths


async def test_the_holder_reaching_furthest_gets_the_request(
    tiny_model_dir: Path, prompt_tokens: dict[str, int]
) -> None:
    """Of several instances holding the prompt's leading chunks, the one reaching furthest is where
    the prompt's KV is; both orders of the two engines, so no name decides it.

    Kills: in ``scheduling/index/lmcache_controller.py`` ``best_holder``, ``max`` -> ``min``.
    """
    async with (
        stand_in_controller() as controller,
        stubs(StubEngine("A", [MODEL]), StubEngine("B", [MODEL])) as urls,
        running_router(urls, **settings(controller, tiny_model_dir)) as (url, router),
    ):
        by_name = {e.url: e.name for e in router.registry.engines()}
        a, b = by_name[urls[0]], by_name[urls[1]]
        for topic, (far, near), stub in (("alpha", (a, b), "A"), ("beta", (b, a), "B")):
            controller.layout = {far: ("LocalCPUBackend", 512), near: ("LocalCPUBackend", 256)}
            engine, seen = await ask(url, topic)
            assert engine == stub and seen["reason"] == "lmcache_hit", seen
            assert seen["lmcache"] == far and seen["matched"] == f"512/{prompt_tokens[topic]}", seen
        assert [len(ids) for ids in controller.asked] == [prompt_tokens["alpha"], prompt_tokens["beta"]]
        assert metric_value(router, LOOKUPS, model=MODEL, outcome="routed") == 2


async def test_a_holder_lacking_more_than_the_threshold_does_not_get_the_request(
    tiny_model_dir: Path, prompt_tokens: dict[str, int]
) -> None:
    """The holder is taken only while the prompt tokens it lacks are at most ``kv_aware_threshold``;
    lacking more, the request is the prefix-cache fallback's (which here picks the other engine: it
    spreads a new prefix to the engine holding fewer blocks, and the holder was sent the first one).

    Kills: in ``scheduling/plugins/lmcache_lookup_picker.py`` ``_holder``, ``if lacking >
    self.threshold`` made false (the threshold disabled) or ``>=`` (a lack of exactly the threshold
    refused).
    """
    extra = {"kv_aware_threshold": prompt_tokens["alpha"] - 512}  # exactly what alpha's holder lacks
    async with (
        stand_in_controller() as controller,
        stubs(StubEngine("A", [MODEL]), StubEngine("B", [MODEL])) as urls,
        running_router(urls, **settings(controller, tiny_model_dir, **extra)) as (url, router),
    ):
        holder = next(e.name for e in router.registry.engines() if e.url == urls[0])
        assert prompt_tokens["beta"] - 256 > extra["kv_aware_threshold"]
        controller.layout = {holder: ("LocalCPUBackend", 512)}  # lacks the threshold: within
        engine, seen = await ask(url, "alpha")
        assert engine == "A" and seen["reason"] == "lmcache_hit", seen
        controller.layout = {holder: ("LocalCPUBackend", 256)}  # lacks more than the threshold
        engine, seen = await ask(url, "beta")
        assert seen["lmcache"] == holder and seen["reason"].startswith("prefix_"), seen
        assert engine == "B", seen
        outcomes = {
            o: metric_value(router, LOOKUPS, model=MODEL, outcome=o) for o in ("routed", "below_threshold")
        }
        assert outcomes == {"routed": 1, "below_threshold": 1}
