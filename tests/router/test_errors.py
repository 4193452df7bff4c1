"""Every error the router answers itself, in OpenAI's JSON shape, through raw HTTP and the openai client."""

from __future__ import annotations

import logging
import socket

import openai
import pytest

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import client, http, running_router, stubs, wait_for

MSG = [{"role": "user", "content": "hi"}]


def assert_openai_error(r, status: int, code: str | None = None) -> dict:  # noqa: ANN001
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"[1, 2]", "invalid_json"),
        (b"", "invalid_json"),
        (b'{"messages": []}', "missing_model"),
        (b'{"model": 42}', "invalid_model"),
    ],
)
async def test_bad_bodies_are_400(router2, body: bytes, code: str) -> None:
    url, router, engines = router2
    async with http(url) as h:
        r = await h.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, code)
    assert not any(e.seen for e in engines)
    assert r.headers["x-request-id"]


async def test_unknown_model_is_404_naming_available_models(router2) -> None:
    url, _, _ = router2
    with pytest.raises(openai.NotFoundError) as exc:
        await client(url).chat.completions.create(model="nope", messages=MSG)
    assert "stub-model" in exc.value.message
    assert exc.value.status_code == 404


async def test_body_over_limit_is_413_with_and_without_content_length(two_stubs) -> None:
    _, urls = two_stubs
    async with running_router(urls, max_body_bytes=1000) as (url, _):
        big = b'{"model": "stub-model", "prompt": "' + b"x" * 2000 + b'"}'
        async with http(url) as h:
            assert_openai_error(await h.post("/v1/completions", content=big), 413, "body_too_large")

            async def chunked():
                for i in range(0, len(big), 100):
                    yield big[i : i + 100]

            assert_openai_error(await h.post("/v1/completions", content=chunked()), 413, "body_too_large")
            ok = await h.post("/v1/completions", json={"model": "stub-model", "prompt": "x"})
            assert ok.status_code == 200


async def test_no_healthy_engine_is_503_with_retry_after() -> None:
    engine = StubEngine("e", ["stub-model"])
    async with stubs(engine) as urls, running_router(urls) as (url, router):
        engine.healthy = False
        await wait_for(lambda: router.registry.healthy_count == 0, what="the engine's failed health check")
        async with http(url) as h:
            r = await h.post("/v1/chat/completions", json={"model": "stub-model", "messages": MSG})
            err = assert_openai_error(r, 503, "no_healthy_engine")
            assert r.headers["retry-after"] == "1"
            assert "stub-model" in err["message"]
            assert (await h.get("/ready")).status_code == 503
    with pytest.raises(openai.InternalServerError):  # the SDK maps 503 to InternalServerError
        raise openai.InternalServerError("x", response=r, body=None)


async def test_upstream_timeout_is_504() -> None:
    engine = StubEngine("slow", ["stub-model"])
    async with stubs(engine) as urls, running_router(urls, request_timeout=0.3) as (url, _):
        engine.behaviour.delay_s = 2
        async with http(url) as h:
            r = await h.post("/v1/chat/completions", json={"model": "stub-model", "messages": MSG})
        assert_openai_error(r, 504, "upstream_timeout")


async def test_unknown_path_404_and_wrong_method_405(router2) -> None:
    url, _, _ = router2
    async with http(url) as h:
        assert_openai_error(await h.get("/v1/nothing"), 404, "not_found")
        assert_openai_error(await h.get("/v1/chat/completions"), 405, "method_not_allowed")
        assert_openai_error(await h.post("/v1/models", json={}), 405, "method_not_allowed")


async def test_multipart_without_model_is_400(router2) -> None:
    url, _, _ = router2
    async with http(url) as h:
        r = await h.post("/v1/audio/transcriptions", files={"file": ("a.wav", b"abc", "audio/wav")})
    assert_openai_error(r, 400, "missing_model")


async def test_client_api_keys_and_engine_key(two_stubs, tmp_path, caplog) -> None:
    engines, urls = two_stubs
    keys = tmp_path / "keys"
    keys.write_text("# comment\nclient-key-1\nclient-key-2\n")
    caplog.set_level(logging.DEBUG)
    async with running_router(
        urls,
        api_keys_file=str(keys),
        environ={"VLLM_API_KEY": "engine-secret", "VLLM_STACK_API_KEYS": "env-key"},
    ) as (url, _):
        with pytest.raises(openai.AuthenticationError):
            await client(url, "wrong").chat.completions.create(model="stub-model", messages=MSG)
        with pytest.raises(openai.AuthenticationError):
            await client(url, "client-key").models.list()  # a prefix of a key is not a key
        for key in ("client-key-2", "env-key"):
            out = await client(url, key).chat.completions.create(model="stub-model", messages=MSG)
            assert out.choices[0].message.content
        async with http(url) as h:
            assert (await h.get("/health")).status_code == 200  # probes need no key
            assert (await h.get("/engines")).status_code == 401
            r = await h.post(
                "/v1/messages",
                json={"model": "stub-model", "messages": MSG},
                headers={"x-api-key": "client-key-1"},
            )
            assert r.status_code == 200
    auths = {s.headers.get("authorization") for e in engines for s in e.seen}
    assert auths == {"Bearer engine-secret"}  # the engines' key replaces the client's
    assert all("x-api-key" not in s.headers for e in engines for s in e.seen)
    for secret in ("client-key-1", "client-key-2", "env-key", "engine-secret"):
        assert secret not in caplog.text


async def test_request_to_unreachable_only_engine_is_an_error_not_500() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    async with running_router([dead], wait_healthy=0) as (url, _):
        async with http(url) as h:
            r = await h.post("/v1/chat/completions", json={"model": "stub-model", "messages": MSG})
    assert_openai_error(r, 503, "no_healthy_engine")
