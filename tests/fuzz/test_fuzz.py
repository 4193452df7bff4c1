"""Property-based fuzzing of every endpoint the router answers: the proxied ones (from the pinned
engine's own OpenAPI schema, ``engine_openapi.json``) and the router's own (``router_openapi.yaml``).

The property: whatever a client sends, the router never answers a 5xx of its own making, and every
answer it makes itself (``x-vllm-stack-error`` header) is an OpenAI-shaped JSON error. See
``fuzzing.py`` for the exact checks and ``regen_engine_schema.py`` to refresh the engine schema.
"""

from __future__ import annotations

import os
import time

import pytest
import requests

from tests.fakes.fuzz_stub import NeverFailingStub
from tests.fakes.stub_engine import StubEngine
from tests.fuzz import fuzzing
from tests.fuzz.stack import router_in_thread

# Cases per operation and generation mode (positive, negative). Generation dominates the time (the
# engine schemas are large; answers take a few per cent of it; /pooling negative alone draws ~1 s per
# case): 6 measured 25-35 s with the two cores quiet and 50-80 s while other engines and tests ran.
# More for a deeper local run: VLLM_STACK_FUZZ_EXAMPLES=30 (852 cases, 150 s loaded).
STUB_EXAMPLES = int(os.environ.get("VLLM_STACK_FUZZ_EXAMPLES", "6"))
ENGINE_EXAMPLES = 3


def test_engine_schema_covers_the_proxied_paths() -> None:
    """The committed engine schema must describe what the router proxies, or the fuzz pass silently
    tests less; a path the pinned engine does not serve is listed in the file and allowed here."""
    from vllm_stack.endpoint_table import ENDPOINTS

    schema = fuzzing.engine_schema()
    absent = set(schema["x-vllm-stack"]["proxied_paths_not_in_engine_schema"])
    assert set(schema["paths"]) | absent == ENDPOINTS.proxied
    assert len(schema["paths"]) >= 10


def test_router_schema_describes_the_routers_own_endpoints() -> None:
    """The hand-written schema of the router's own endpoints has every row of the endpoint table that is
    not proxied (and no other), so a new one of them is fuzzed as soon as the table has it."""
    from vllm_stack.endpoint_table import ENDPOINTS

    described = {path for path in fuzzing.router_schema()["paths"] if "{" not in path}
    assert described == {row.path for row in ENDPOINTS.rows if not row.proxied}


def test_fuzz_against_a_stub_engine_no_router_5xx_and_openai_errors(tmp_path) -> None:  # noqa: ANN001
    """Stub pass (no real engine; the stub cannot answer 5xx, see ``tests/fakes/fuzz_stub.py``, so a
    5xx or an unmarked non-engine answer can only be the router's). Also checks that the number of
    examples run is what was asked for, so a schema that stops generating is noticed."""
    stub = NeverFailingStub(StubEngine("fuzz", ["stub-model"]))
    ops = fuzzing.operations(fuzzing.engine_schema()) + fuzzing.operations(fuzzing.router_schema())
    report = fuzzing.Report()
    started = time.monotonic()
    with (
        router_in_thread(
            stub_apps=[stub], max_body_bytes=1 << 20, batch_api=True, batch_dir=str(tmp_path / "batch")
        ) as (url, _),
        requests.Session() as session,
    ):
        target = fuzzing.Target(url, session, "stub-model", expect_engine_header=True, report=report)
        fuzzing.fuzz(target, ops, STUB_EXAMPLES)
    elapsed = time.monotonic() - started
    print(fuzzing.summary(report), f"\n{elapsed:.1f} s")
    assert stub.answered_5xx == 0
    assert not fuzzing.unexpected(report), fuzzing.summary(report)
    with_inputs = [k for k in report.examples if k.startswith("POST")]
    assert len(report.examples) == len(ops)
    for key in with_inputs:  # positive + negative, each up to STUB_EXAMPLES
        assert report.examples[key] >= STUB_EXAMPLES, (key, report.examples[key])
    assert report.total >= STUB_EXAMPLES * len(with_inputs)


@pytest.mark.engine
def test_fuzz_against_real_engines_no_router_5xx(engines, embedding_engine) -> None:
    """Real-engine pass (the session's two chat engines and its embedding engine): the same cases reach
    real vLLM, whose answers (its own 4xx and 5xx included) pass through unmarked and are not failures;
    a 5xx the router makes is. Generation is bounded (``max_tokens``/``n`` capped) so the pass stays
    about 30 s on CPU engines."""
    ops = fuzzing.operations(fuzzing.engine_schema())
    report = fuzzing.Report()
    chat, embed = engines[0].served_model_name, embedding_engine.served_model_name

    def model_for(path: str) -> str:
        return embed if path in POOLING_PATHS else chat

    started = time.monotonic()
    backends = [*engines.urls, embedding_engine.url]
    with router_in_thread(backends=backends) as (url, _), requests.Session() as session:
        target = fuzzing.Target(
            url,
            session,
            model_for,
            expect_engine_header=False,
            report=report,
            timeout=60,
            adjust_body=_bounded,
        )
        fuzzing.fuzz(target, ops, ENGINE_EXAMPLES)
    print(fuzzing.summary(report), f"\n{time.monotonic() - started:.1f} s")
    assert not fuzzing.unexpected(report), fuzzing.summary(report)
    assert len(report.examples) == len(ops)
    assert all(n >= ENGINE_EXAMPLES for n in report.examples.values()), report.examples


POOLING_PATHS = frozenset({"/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank"})


async def test_lora_load_for_an_unknown_base_model_is_404() -> None:
    """Found by the stub fuzz pass: ``POST /v1/load_lora_adapter`` naming a ``base_model`` that no
    engine serves is answered 503 ``no_healthy_engine`` with ``Retry-After`` (a client retries a
    request that can never succeed) instead of 404 ``model_not_found`` as for an unknown ``model``
    on the proxied endpoints. A stub engine: only the router's own answer matters."""
    from tests.router.helpers import http, running_router, stubs

    adapter = {"name": "x", "source": "/x", "base_model": "nope"}
    env = {"VLLM_STACK_ADMIN_API_KEYS": "admin"}
    async with stubs(StubEngine("s", ["stub-model"])) as urls:
        async with running_router(urls, environ=env, lora_adapters=[adapter]) as (url, _), http(url) as h:
            r = await h.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "x", "lora_path": "/x", "base_model": "nope"},
                headers={"authorization": "Bearer admin"},
            )
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"


def _bounded(body: dict) -> None:
    for name, cap in (("max_tokens", 8), ("max_completion_tokens", 8), ("max_output_tokens", 8), ("n", 2)):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap
