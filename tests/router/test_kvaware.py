"""kvaware routing against a real ``lmcache_controller`` (LMCache 0.5.6 on CPU).

The engines' LMCache workers cannot run here (the vLLM LMCache connector needs CUDA), so
``tests/fakes/lmcache_worker.py`` stands in for them: it registers instances and admits or evicts
chunks through the controller's own ZMQ protocol with LMCache's own message classes and chunk
hashes. The engines behind the router are stubs named as the chart names LMCache instances (the
engine's name: ``host:port`` under static discovery). What is real: the controller's lookup, its
hashing of the token ids the router sends, and the router's tokenizing of the chat request with the
model's own tokenizer and template.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from vllm_stack_dev.testbed.engines import free_port
from vllm_stack_dev.testbed.lmcache import unpack_lmcache

from tests.fakes.lmcache_procs import Controller, Workers
from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import metric_value, running_router, stubs
from vllm_stack.director.request import route_header
from vllm_stack.scheduling.index.tokens import ChatTokenizer

pytestmark = pytest.mark.engine  # the engine environment runs the controller

MODEL = "tiny-llama"
LOOKUPS = "vllm_stack_router_lmcache_lookups_total"


@pytest.fixture(scope="module")
def lmcache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Controller, Workers]]:
    folder = tmp_path_factory.mktemp("lmcache")
    site = unpack_lmcache(folder)
    controller = Controller(site, folder / "controller.log")
    workers = Workers(controller, site)
    try:
        yield controller, workers
    finally:
        workers.stop()
        controller.stop()


def document(topic: str, words: int = 320) -> list[dict[str, str]]:
    """A chat whose templated prompt is several 256-token chunks, distinct per topic."""
    text = " ".join(f"{topic} fact {i} is recorded in the shared document" for i in range(words // 8))
    return [{"role": "user", "content": text}]


def chat(messages: list[dict[str, str]]) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": 4}


async def post(url: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r


def route(r: httpx.Response) -> dict[str, str]:
    """The x-vllm-stack-route header as a mapping (profile, reason, engine, lmcache, matched, ...)."""
    parts = [p.strip().split("=", 1) for p in r.headers["x-vllm-stack-route"].split(";")]
    return {k: v for k, v in parts}


def settings(controller: Controller, tiny_model_dir: Path, **extra: object) -> dict:
    return {
        "routing_logic": "kvaware",
        "lmcache_controller_url": controller.url,
        "tokenizers": f"{MODEL}={tiny_model_dir}",
        "static_models": f"{MODEL},{MODEL},{MODEL}",
        "debug_headers": True,
        **extra,
    }


async def test_requests_go_where_lmcache_holds_their_prompt(lmcache, tiny_model_dir) -> None:
    controller, workers = lmcache
    tokenizer = ChatTokenizer(tiny_model_dir)
    async with stubs(StubEngine(), StubEngine(), StubEngine()) as urls:
        async with running_router(urls, **settings(controller, tiny_model_dir)) as (url, router):
            names = [e.name for e in sorted(router.registry.engines(), key=lambda e: e.name)]
            for name in names:
                workers.register(name)
            # each document's KV is in a different engine's LMCache; each request goes there, whatever
            # the prefix-cache index would say (it has seen none of these prompts)
            for topic, holder in zip(("alpha", "beta", "gamma"), (names[2], names[0], names[1]), strict=True):
                messages = document(topic)
                ids = list(tokenizer.chat_ids({"messages": messages}))
                assert len(ids) > 512
                workers.admit(holder, ids)
                for _ in range(2):
                    seen = route(await post(url, chat(messages)))
                    assert seen["engine"] == holder and seen["reason"] == "lmcache_hit", seen
                    assert seen["lmcache"] == holder and seen["matched"] == f"{len(ids)}/{len(ids)}", seen
            assert metric_value(router, LOOKUPS, model=MODEL, outcome="routed") == 6
            # the same prompt once LMCache evicted it: the cache-aware fallback, which learnt where it went
            workers.evict(names[2], ids_of(tokenizer, "alpha"))
            seen = route(await post(url, chat(document("alpha"))))
            assert seen["reason"].startswith("prefix_") and "lmcache" not in seen, seen
            assert seen["engine"] == names[2], seen  # the index recorded the kvaware placements
            assert metric_value(router, LOOKUPS, model=MODEL, outcome="miss") == 1
            assert (
                router.metrics.registry.get_sample_value("vllm_stack_router_lmcache_lookup_seconds_count")
                == 7
            )


def ids_of(tokenizer: ChatTokenizer, topic: str) -> list[int]:
    return list(tokenizer.chat_ids({"messages": document(topic)}))


async def test_a_holder_lacking_too_much_or_not_an_engine_falls_back(lmcache, tiny_model_dir) -> None:
    controller, workers = lmcache
    tokenizer = ChatTokenizer(tiny_model_dir)
    async with stubs(StubEngine(), StubEngine()) as urls:
        extra = {"kv_aware_threshold": 300, "static_models": f"{MODEL},{MODEL}"}
        async with running_router(urls, **settings(controller, tiny_model_dir, **extra)) as (url, router):
            first = sorted(e.name for e in router.registry.engines())[0]
            workers.register(first)
            workers.register("someone-else")
            long_ids = ids_of(tokenizer, "delta")
            workers.admit(first, long_ids[:256])  # one chunk of a prompt of more than 512 + 300 tokens
            assert len(long_ids) - 256 > 300
            seen = route(await post(url, chat(document("delta"))))
            assert seen["lmcache"] == first and seen["matched"] == f"256/{len(long_ids)}", seen
            assert seen["reason"] != "lmcache_hit", seen
            workers.admit("someone-else", ids_of(tokenizer, "epsilon"))
            seen = route(await post(url, chat(document("epsilon"))))
            assert seen["lmcache"] == "someone-else" and seen["reason"] != "lmcache_hit", seen
            # a prompt under one chunk is not looked up
            await post(url, chat([{"role": "user", "content": "hello"}]))
            outcomes = {
                o: metric_value(router, LOOKUPS, model=MODEL, outcome=o)
                for o in ("below_threshold", "holder_unavailable", "short_prompt")
            }
            assert outcomes == {"below_threshold": 1, "holder_unavailable": 1, "short_prompt": 1}


async def test_a_controller_that_is_down_costs_requests_nothing_but_the_fallback(tiny_model_dir) -> None:
    """No controller listens there: the lookup fails at once, the request is served by the fallback,
    and the next requests within the backoff do not ask at all."""
    async with stubs(StubEngine()) as urls:
        dead = f"http://127.0.0.1:{_closed_port()}"
        extra = {
            "routing_logic": "kvaware",
            "lmcache_controller_url": dead,
            "tokenizers": f"{MODEL}={tiny_model_dir}",
        }
        async with running_router(urls, static_models=MODEL, debug_headers=True, **extra) as (url, router):
            for _ in range(3):
                seen = route(await post(url, chat(document("zeta"))))
                assert seen["reason"].startswith("prefix_"), seen
            assert metric_value(router, LOOKUPS, model=MODEL, outcome="error") == 1
            assert metric_value(router, LOOKUPS, model=MODEL, outcome="backoff") == 2


def _closed_port() -> int:
    return free_port()


async def test_the_route_header_is_off_by_default_and_the_engines_describe_the_picker(
    lmcache, tiny_model_dir
) -> None:
    controller, _ = lmcache
    async with stubs(StubEngine()) as urls:
        cfg = settings(controller, tiny_model_dir, static_models=MODEL)
        del cfg["debug_headers"]
        async with running_router(urls, **cfg) as (url, router):
            r = await post(url, chat(document("eta")))
            assert "x-vllm-stack-route" not in r.headers
            state = router.scheduling_description()["state"]["lmcache-lookup-picker"]
            assert state["controller_url"] == controller.url and state["threshold"] == 2000


def test_the_route_header_stays_one_line_whatever_names_and_notes_hold() -> None:
    """Engine names come from discovery and instance ids from the controller: neither can add a header."""
    value = route_header("kvaware", "lmcache_hit", "pod\r\nx-evil: 1", "lmcache=\x00é")
    assert value == b"profile=kvaware; reason=lmcache_hit; engine=pod??x-evil: 1; lmcache=??"
