"""External OpenAI-compatible providers (production-stack's ``--external-providers-config``): the file
format, the provider's models beside the local ones, its key replacing the client's, TLS verified
against a private CA, and its 429 passed back. Stub engines play the providers here (fast); the real
vLLM engine behind TLS with ``--api-key`` is in ``test_external_providers_engines.py``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.fakes.certs import make_ca_and_server_cert
from tests.fakes.raw_engine import raw_engine
from tests.fakes.stub_engine import StubEngine, serve
from tests.router.helpers import FAST, http, metric_value, serving, stubs, wait_for
from vllm_stack.app import build_router
from vllm_stack.config import ConfigError
from vllm_stack.engines.external import load_providers, parse_providers

KEY = "sk-provider-secret-0123456789"
LOCAL_KEY = "local-engine-key-abcdef"
#: a provider whose key is read from the variable K
KEYED = {
    "name": "p",
    "type": "openai",
    "api_base": "https://x",
    "models": [{"id": "m"}],
    "api_key_env_var": "K",
}
MSG = [{"role": "user", "content": "hi"}]


def providers_file(tmp_path: Path, api_base: str, **extra: object) -> str:
    """A file in production-stack's format: one provider, one model with an alias."""
    doc = {
        "external_providers": [
            {
                "name": "acme",
                "type": "openai",
                "api_base": api_base,
                "api_key_env_var": "ACME_API_KEY",
                "timeout": 30.0,
                "max_retries": 3,
                "models": [{"id": "acme-large", "type": "chat", "aliases": ["large"]}],
                **extra,
            }
        ]
    }
    path = tmp_path / "providers.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_the_file_format_is_production_stacks(tmp_path: Path) -> None:
    """ids and aliases routable, the key read from the named variable and kept out of the repr."""
    (provider,) = load_providers(providers_file(tmp_path, "https://api.example.com/"), {"ACME_API_KEY": KEY})
    assert provider.api_base == "https://api.example.com"
    assert dict(provider.models) == {"acme-large": "acme-large", "large": "acme-large"}
    assert provider.aliases == {"large": "acme-large"}
    assert provider.control_headers() == {"authorization": "Bearer " + KEY}
    assert KEY not in repr(provider)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"type": "anthropic"}, "type 'anthropic' is not one of"),
        ({"api_base": "ftp://x"}, "api_base must be an http(s):// URL"),
        ({"models": []}, "'models' must be a non-empty list"),
        ({"custom_headers": {"Authorization": "x"}}, "may not set authorization"),
        ({"colour": "red"}, "unknown keys ['colour']"),
    ],
)
def test_a_file_that_cannot_work_is_refused_with_the_reason(change: dict, message: str) -> None:
    doc = {"name": "p", "type": "openai", "api_base": "https://x", "models": [{"id": "m"}], **change}
    with pytest.raises(ConfigError) as err:
        parse_providers({"external_providers": [doc]}, {})
    assert message in str(err.value)


def test_an_unreadable_ca_bundle_is_refused_with_the_provider_and_file(tmp_path: Path) -> None:
    path = providers_file(tmp_path, "https://api.example.com", ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="external provider 'acme': CA bundle .*missing.pem"):
        build_router({**FAST, "external_providers_config": path}, environ={"ACME_API_KEY": KEY})


def test_an_unset_key_variable_and_a_model_named_twice_are_refused() -> None:
    doc = dict(KEYED)
    with pytest.raises(ConfigError, match="its key variable K is not set"):
        parse_providers({"external_providers": [doc]}, {})
    other = {**doc, "name": "q", "api_base": "https://y"}
    with pytest.raises(ConfigError, match="model 'm' is named by external providers 'p' and 'q'"):
        parse_providers({"external_providers": [doc, other]}, {"K": "v"})


def test_a_keys_surrounding_whitespace_is_taken_away_and_a_line_break_inside_refused() -> None:
    """A Secret written with ``echo`` ends in a newline: every probe failed on aiohttp's header check."""
    doc = dict(KEYED)
    (provider,) = parse_providers({"external_providers": [doc]}, {"K": f" {KEY}\r\n"})
    assert provider.control_headers() == {"authorization": "Bearer " + KEY}
    for bad in (f"{KEY}\nX-Injected: 1", f"sk\x00{KEY}"):
        with pytest.raises(ConfigError, match="the key in K has a control character") as err:
            parse_providers({"external_providers": [doc]}, {"K": bad})
        assert KEY not in str(err.value)


async def test_provider_beside_a_local_engine_over_tls_with_its_own_key(tmp_path: Path, caplog) -> None:
    """The provider (a stub behind TLS, its certificate from a private CA) serves its model and alias
    beside the local engine's; its requests carry its key, never the client's nor the engines'; the
    alias reaches it as its own id; streams pass through; the key shows nowhere."""
    caplog.set_level(logging.DEBUG)
    certs = make_ca_and_server_cert(tmp_path / "ca")
    provider, local = StubEngine("acme", ["acme-large"]), StubEngine("local", ["stub-model"])
    async with serve(provider, tls=(certs.cert_file, certs.key_file)) as provider_url, stubs(local) as urls:
        router = build_router(
            {
                **FAST,
                "routing_logic": "roundrobin",
                "static_backends": urls[0],
                "external_providers_config": providers_file(tmp_path, provider_url),
                "external_ca_file": certs.ca_file,
            },
            environ={"ACME_API_KEY": KEY, "VLLM_API_KEY": LOCAL_KEY},
        )
        async with serving(router) as url, http(url) as h:
            await wait_for(
                lambda: router.registry.healthy_count == 2, what="the engine and the provider healthy"
            )
            models = (await h.get("/v1/models")).json()["data"]
            assert {(m["id"], m["owned_by"]) for m in models} == {
                ("stub-model", "vllm"),
                ("acme-large", "acme"),
                ("large", "acme"),
            }
            client_auth = {"authorization": "Bearer client-key"}
            answer = await h.post(
                "/v1/chat/completions",
                json={"model": "large", "messages": MSG, "max_tokens": 3},
                headers=client_auth,
            )
            assert answer.status_code == 200, answer.text
            sent = provider.seen[-1]
            assert sent.headers["authorization"] == "Bearer " + KEY
            assert [v for k, v in sent.header_list if k == "authorization"] == ["Bearer " + KEY]
            assert b'"model":"acme-large"' in sent.body.replace(b" ", b"")
            async with h.stream(
                "POST",
                "/v1/completions",
                json={"model": "acme-large", "prompt": "hi", "max_tokens": 4, "stream": True},
                headers=client_auth,
            ) as stream:
                assert stream.status_code == 200
                events = [line async for line in stream.aiter_lines() if line.startswith("data: ")]
            assert len(events) == 5 and events[-1] == "data: [DONE]"
            await h.post(
                "/v1/chat/completions", json={"model": "stub-model", "messages": MSG, "max_tokens": 1}
            )
            assert local.seen[-1].headers["authorization"] == "Bearer " + LOCAL_KEY
            engines = (await h.get("/engines")).text
            assert "external:acme" in engines
            assert (
                metric_value(
                    router,
                    "vllm_stack_router_requests_total",
                    model="large",
                    engine="external:acme",
                    status="200",
                )
                == 1
            )
            metrics = (await h.get("/metrics")).text
        for text in (
            engines,
            metrics,
            answer.text,
            caplog.text,
            *(s.headers.get("authorization", "") for s in local.seen),
        ):
            assert KEY not in text
        for seen in provider.seen:
            assert LOCAL_KEY not in str(seen.header_list) and "client-key" not in str(seen.header_list)


async def test_a_provider_signed_by_another_ca_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    """TLS is verified: a provider whose certificate another CA signed gets no request; the client's
    answer is an OpenAI-shaped 502 that says why (the certificate), without the key."""
    served = make_ca_and_server_cert(tmp_path / "theirs", name="their-ca")
    trusted = make_ca_and_server_cert(tmp_path / "ours", name="our-ca")
    provider = StubEngine("acme", ["acme-large"])
    async with serve(provider, tls=(served.cert_file, served.key_file)) as provider_url:
        router = build_router(
            {
                **FAST,
                "service_discovery": "external-only",
                "external_providers_config": providers_file(tmp_path, provider_url),
                "external_ca_file": trusted.ca_file,
            },
            environ={"ACME_API_KEY": KEY},
        )
        async with serving(router) as url, http(url) as h:
            await wait_for(
                lambda: router.registry.engines()[0].last_error is not None, what="the first probe's failure"
            )
            answer = await h.post("/v1/chat/completions", json={"model": "acme-large", "messages": MSG})
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert "CERTIFICATE_VERIFY_FAILED" in error["message"] and "acme" in error["message"]
    assert KEY not in answer.text
    assert not [s for s in provider.seen if s.method == "POST"]


async def test_the_providers_429_and_retry_after_reach_the_client(tmp_path: Path) -> None:
    """A provider over its rate limit answers 429 with retry-after: the client gets both, as sent.
    A raw stand-in plays the provider: no real engine answers 429 on demand."""
    limited = b'{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}'

    async def answer(head: bytes, body: bytes, writer) -> bool:  # noqa: ANN001 - asyncio.StreamWriter
        writer.write(
            b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 7\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(limited), limited)
        )
        return True

    async with raw_engine(answer) as provider_url:
        path = tmp_path / "p.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "external_providers": [
                        {
                            "name": "acme",
                            "type": "openai",
                            "api_base": provider_url,
                            "models": [{"id": "stub-model"}],
                        }
                    ]
                }
            )
        )
        router = build_router(
            {**FAST, "service_discovery": "external-only", "external_providers_config": str(path)}, environ={}
        )
        async with serving(router) as url, httpx.AsyncClient(base_url=url) as h:
            await wait_for(lambda: router.registry.healthy_count == 1, what="the provider healthy")
            got = await h.post("/v1/chat/completions", json={"model": "stub-model", "messages": MSG})
    assert got.status_code == 429
    assert got.headers["retry-after"] == "7"
    assert got.content == limited


async def test_the_sleep_endpoints_refuse_a_provider_and_never_call_it(tmp_path: Path) -> None:
    """/sleep, /wake_up and /is_sleeping address the stack's engines only: a provider's id is a 400 and
    the provider gets no call (the call carried the engines' VLLM_API_KEY)."""
    provider = StubEngine("acme", ["acme-large"])
    async with serve(provider) as provider_url:
        router = build_router(
            {
                **FAST,
                "service_discovery": "external-only",
                "external_providers_config": providers_file(tmp_path, provider_url),
            },
            environ={"ACME_API_KEY": KEY, "VLLM_API_KEY": LOCAL_KEY},
        )
        async with serving(router) as url, http(url) as h:
            await wait_for(lambda: router.registry.healthy_count == 1, what="the provider healthy")
            (engine,) = router.registry.engines()
            for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
                for wanted in (engine.engine_id, engine.name):
                    r = await h.request(method, path, params={"id": wanted})
                    assert (r.status_code, r.json()["error"]["code"]) == (400, "engine_cannot_sleep"), path
    assert not [s for s in provider.seen if "sleep" in s.path or "wake" in s.path]


async def test_a_provider_whose_health_probe_is_rate_limited_stays_in_rotation(tmp_path: Path) -> None:
    """A 429 (with retry-after) on the ``/v1/models`` probe says the provider is reachable: it stays
    healthy through many such probes and keeps serving (was: out of rotation, every request 502)."""
    provider = StubEngine("acme", ["acme-large"])
    probes: list[int] = []

    async def limited_probe(scope: dict, receive: Any, send: Any) -> None:  # noqa: ANN401
        if scope["type"] == "http" and scope["path"] == "/v1/models":
            probes.append(1)
            headers = [(b"content-type", b"application/json"), (b"retry-after", b"30")]
            await send({"type": "http.response.start", "status": 429, "headers": headers})
            await send({"type": "http.response.body", "body": b'{"error":{"message":"Rate limit reached"}}'})
            return
        await provider(scope, receive, send)

    async with serve(limited_probe) as provider_url:
        router = build_router(
            {
                **FAST,
                "service_discovery": "external-only",
                "external_providers_config": providers_file(tmp_path, provider_url),
            },
            environ={"ACME_API_KEY": KEY},
        )
        async with serving(router) as url, http(url) as h:
            await wait_for(lambda: len(probes) >= 4, what="four health probes answered 429")
            assert router.registry.healthy_count == 1
            answer = await h.post("/v1/chat/completions", json={"model": "large", "messages": MSG})
            assert answer.status_code == 200, answer.text


async def test_a_model_served_locally_and_by_a_provider_gets_each_legs_key_and_name(tmp_path: Path) -> None:
    """``large`` is a local engine's model and the provider's alias of ``acme-large``: a local leg
    carries the engines' key and the client's name, a provider's leg its own key and its own id
    (was: no key on the local leg and the alias rewritten on both)."""
    provider, local = StubEngine("acme", ["acme-large"]), StubEngine("local", ["large"])
    async with serve(provider) as provider_url, stubs(local) as urls:
        router = build_router(
            {
                **FAST,
                "routing_logic": "roundrobin",
                "static_backends": urls[0],
                "external_providers_config": providers_file(tmp_path, provider_url),
            },
            environ={"ACME_API_KEY": KEY, "VLLM_API_KEY": LOCAL_KEY},
        )
        async with serving(router) as url, http(url) as h:
            await wait_for(
                lambda: router.registry.healthy_count == 2, what="the engine and the provider healthy"
            )
            for _ in range(4):  # round robin: both legs
                r = await h.post("/v1/chat/completions", json={"model": "large", "messages": MSG})
                assert r.status_code == 200, r.text
    to_local = [s for s in local.seen if s.method == "POST"]
    to_provider = [s for s in provider.seen if s.method == "POST"]
    assert to_local and to_provider
    for sent in to_local:
        assert [v for k, v in sent.header_list if k == "authorization"] == ["Bearer " + LOCAL_KEY]
        assert b'"model":"large"' in sent.body.replace(b" ", b"")
    for sent in to_provider:
        assert [v for k, v in sent.header_list if k == "authorization"] == ["Bearer " + KEY]
        assert b'"model":"acme-large"' in sent.body.replace(b" ", b"")
