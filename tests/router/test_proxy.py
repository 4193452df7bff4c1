"""Proxy behaviour over stub engines: endpoints, streaming, headers, /v1/models (no real vLLM needed)."""

from __future__ import annotations

import time

import pytest

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import client, http, running_router, stubs

MSG = [{"role": "user", "content": "hi"}]


async def test_chat_non_streaming_with_openai_client(router2) -> None:
    url, router, engines = router2
    resp = await client(url).chat.completions.with_raw_response.create(
        model="stub-model", messages=MSG, max_tokens=4
    )
    completion = resp.parse()
    assert completion.choices[0].message.content == "tok " * 4
    assert resp.headers["x-request-id"]
    # the generated request id went upstream too
    seen = [s for e in engines for s in e.seen]
    assert [s.headers["x-request-id"] for s in seen] == [resp.headers["x-request-id"]]


async def test_chat_streaming_with_openai_client(router2) -> None:
    url, _, _ = router2
    stream = await client(url).chat.completions.create(
        model="stub-model", messages=MSG, max_tokens=5, stream=True
    )
    parts = [chunk.choices[0].delta.content async for chunk in stream]
    assert parts == [f"t{i} " for i in range(5)]


async def test_completions_and_embeddings(router2) -> None:
    url, _, _ = router2
    c = client(url)
    comp = await c.completions.create(model="stub-model", prompt="hello", max_tokens=3)
    assert comp.choices[0].text == "tok " * 3
    emb = await c.embeddings.create(model="stub-model", input="hello")
    assert emb.data[0].embedding == [0.1, 0.2, 0.3]


@pytest.mark.parametrize(
    "path",
    [
        "/v1/responses",
        "/v1/messages",
        "/v1/rerank",
        "/rerank",
        "/v1/score",
        "/score",
        "/tokenize",
        "/detokenize",
    ],
)
async def test_other_endpoints_are_proxied_to_the_same_path(router2, path: str) -> None:
    url, _, engines = router2
    async with http(url) as h:
        r = await h.post(path + "?x=1", json={"model": "stub-model", "input": "hi"})
    assert r.status_code == 200, r.text
    assert r.json()["path"] == path
    seen = [s for e in engines for s in e.seen if s.path == path]
    assert seen and seen[-1].query == b"x=1"


async def test_tokenize_without_model_uses_the_only_base_model(router2) -> None:
    url, _, _ = router2
    async with http(url) as h:
        r = await h.post("/tokenize", json={"prompt": "hi"})
    assert r.status_code == 200
    assert r.json()["path"] == "/tokenize"


async def test_audio_transcription_multipart_routed_by_form_field(router2) -> None:
    url, _, engines = router2
    async with http(url) as h:
        r = await h.post(
            "/v1/audio/transcriptions",
            data={"model": "stub-model", "language": "en"},
            files={"file": ("a.wav", b"RIFF....WAVEfmt " + bytes(100), "audio/wav")},
        )
    assert r.status_code == 200, r.text
    seen = [s for e in engines for s in e.seen if s.path == "/v1/audio/transcriptions"][-1]
    assert seen.headers["content-type"].startswith("multipart/form-data")
    assert bytes(100) in seen.body  # body forwarded byte for byte


async def test_headers_request_id_traceparent_and_hop_by_hop(router2) -> None:
    url, _, engines = router2
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    async with http(url) as h:
        r = await h.post(
            "/v1/completions",
            json={"model": "stub-model", "prompt": "x"},
            headers={
                "x-request-id": "my-id-1",
                "traceparent": tp,
                "proxy-authorization": "secret",
                "te": "trailers",
                "connection": "keep-alive, X-Hop-Only",
                "x-hop-only": "for the router alone",
            },
        )
    assert r.headers["x-request-id"] == "my-id-1"
    seen = [s for e in engines for s in e.seen if s.headers.get("x-request-id") == "my-id-1"]
    assert len(seen) == 1
    assert seen[0].headers["traceparent"] == tp
    assert "proxy-authorization" not in seen[0].headers and "te" not in seen[0].headers
    assert "x-hop-only" not in seen[0].headers, "headers a Connection header lists stay on this hop"
    assert r.headers["x-stub-engine"] in ("s1", "s2")  # engine headers pass through


async def test_stream_chunks_are_flushed_as_they_arrive() -> None:
    engine = StubEngine("slow", ["stub-model"])
    engine.behaviour.token_delay_s = 0.3
    async with stubs(engine) as urls, running_router(urls) as (url, _):
        async with http(url) as h:
            t0 = time.monotonic()
            async with h.stream(
                "POST",
                "/v1/chat/completions",
                json={"model": "stub-model", "messages": MSG, "stream": True, "max_tokens": 4},
            ) as r:
                arrivals = []
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        arrivals.append(time.monotonic() - t0)
    assert len(arrivals) == 5  # 4 tokens + [DONE]
    assert arrivals[0] < 0.25, arrivals  # the first token did not wait for the others
    assert arrivals[-1] > 0.9


async def test_models_union_dedup_keeps_vllm_fields() -> None:
    a = StubEngine("a", ["base-a"], max_model_len=4096)
    b = StubEngine("b", ["base-a", "base-b"])
    b.add_model("lora-x", parent="base-b")
    async with stubs(a, b) as urls, running_router(urls) as (url, _):
        models = await client(url).models.list()
    ids = [m.id for m in models.data]
    assert ids == ["base-a", "base-b", "lora-x"]
    cards = {m.id: m.model_dump() for m in models.data}
    assert cards["lora-x"]["parent"] == "base-b"
    assert cards["base-a"]["max_model_len"] in (4096, 2048)
    assert cards["base-a"]["root"] == "base-a"


ADMIN = {"VLLM_STACK_ADMIN_API_KEYS": "admin-key"}
AD1 = {"name": "ad1", "source": "/x", "base_model": "stub-model"}


async def test_lora_adapter_fanout_and_routing(two_stubs) -> None:
    engines, urls = two_stubs
    admin = {"authorization": "Bearer admin-key"}
    async with running_router(urls, environ=ADMIN, lora_adapters=[AD1]) as (url, router), http(url) as h:
        r = await h.post("/v1/load_lora_adapter", json={"lora_name": "ad1", "lora_path": "/x"}, headers=admin)
        assert r.status_code == 200, r.text
        assert "added" in r.text
        for e in engines:
            assert "ad1" in e.cards
        # routable at once (the registry learned it from the answers, and re-probes the engines)
        assert len(router.registry.candidates("ad1")) == 2
        # loading it again is no failure: the engines have it (vLLM answers 400 "already been loaded")
        r = await h.post("/v1/load_lora_adapter", json={"lora_name": "ad1"}, headers=admin)
        assert r.status_code == 200, r.text
        models = (await h.get("/v1/models")).json()["data"]
        assert {m["id"]: m["parent"] for m in models}["ad1"] == "stub-model"
        r = await h.post("/v1/completions", json={"model": "ad1", "prompt": "x"})
        assert r.status_code == 200
        r = await h.post("/v1/unload_lora_adapter", json={"lora_name": "ad1"}, headers=admin)
        assert r.status_code == 200
        assert all("ad1" not in e.cards for e in engines)
        # the source comes from the registry when the request gives none
        r = await h.post("/v1/load_lora_adapter", json={"lora_name": "ad1"}, headers=admin)
        assert r.status_code == 200, r.text
        assert all(e.cards["ad1"]["root"] == "/x" for e in engines)


async def test_lora_loads_through_the_router_need_an_admin_key_and_a_registered_source(two_stubs) -> None:
    """Before: any client key could make every engine read an arbitrary path."""
    engines, urls = two_stubs
    body = {"lora_name": "ad1", "lora_path": "/x"}
    env = {**ADMIN, "VLLM_STACK_API_KEYS": "client-key"}
    async with running_router(urls, environ=env, lora_adapters=[AD1]) as (url, _), http(url) as h:
        for headers in ({}, {"authorization": "Bearer client-key"}, {"authorization": "Bearer wrong"}):
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                r = await h.post(path, json=body, headers=headers)
                assert r.status_code == 403, (path, headers, r.text)
                assert r.json()["error"]["code"] == "admin_key_required"
        admin = {"authorization": "Bearer admin-key"}
        r = await h.post(
            "/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": "/etc"}, headers=admin
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_not_registered", r.text
        r = await h.post(
            "/v1/load_lora_adapter", json={"lora_name": "ad1", "lora_path": "/etc"}, headers=admin
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_source_mismatch", r.text
        assert all("ad1" not in e.cards and "evil" not in e.cards for e in engines)
        r = await h.post("/v1/load_lora_adapter", json=body, headers={"x-api-key": "admin-key"})
        assert r.status_code == 200, r.text
    # with no admin key configured the endpoints are off
    async with running_router(urls, lora_adapters=[AD1]) as (url, _), http(url) as h:
        r = await h.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 403 and "no admin key is configured" in r.json()["error"]["message"]


async def test_own_endpoints(router2) -> None:
    url, _, _ = router2
    async with http(url) as h:
        assert (await h.get("/health")).json() == {"status": "ok"}
        ready = await h.get("/ready")
        assert ready.status_code == 200 and ready.json()["healthy_engines"] == 2
        assert "version" in (await h.get("/version")).json()
        engines = (await h.get("/engines")).json()["engines"]
        assert {e["name"] for e in engines} and all(e["healthy"] for e in engines)
        assert all(e["models"] == ["stub-model"] for e in engines)
        metrics = (await h.get("/metrics")).text
        assert "vllm_stack_router_build_info" in metrics
        assert "vllm:" not in metrics
