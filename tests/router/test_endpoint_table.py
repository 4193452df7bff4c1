"""The endpoint table (vllm_stack.endpoint_table) is the one place that lists the router's paths: the
sets every part reads are derived from it (and are the sets the router had before the table), no module
of the router keeps a set of its own, and a new OpenAI endpoint is one row: routed, refused with 405 and
``Allow``, authenticated, traced, batched and disaggregated by that row alone.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.batch.helpers import file_lines, start_batch, wait_batch
from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import FAST, serving, stubs, wait_for
from vllm_stack.api import endpoints
from vllm_stack.app import Router, build_router
from vllm_stack.endpoint_table import ENDPOINTS, GET, Endpoint, EndpointTable

PACKAGE = Path(__file__).resolve().parents[2] / "router" / "vllm_stack"
MODEL = "stub-model"
KEY = "client-key"

# ---- the derived sets are the router's sets before the table ------------------------------------------
#: Every path the router served at 2ac0ed4, before the table.
BEFORE = {
    *("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages"),
    *("/v1/rerank", "/rerank", "/v1/score", "/score", "/tokenize", "/detokenize"),
    *("/v1/audio/transcriptions", "/v1/audio/translations", "/pooling", "/classify", "/v1/classify"),
    *("/health", "/ready", "/version", "/metrics", "/engines", "/v1/models"),
    *("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/files", "/v1/batches"),
}


def test_the_derived_sets_are_the_sets_the_modules_kept_before() -> None:
    """What api/proxied.py, api/routes.py, api/head.py, batch/objects.py, director/disagg.py,
    tracing/otel.py and server/serve.py each listed before the table (as of 2ac0ed4): the same paths,
    methods, keys, Allow headers, batch endpoints (in the order the error message names them) and
    span names, so no path answers otherwise than before. Rows added since are left out (a new
    endpoint adds to these sets; it changes none of the paths that were there)."""
    t = EndpointTable(row for row in ENDPOINTS.rows if row.path in BEFORE)
    model_optional = {"/tokenize", "/detokenize", "/rerank", "/v1/rerank", "/score", "/v1/score"}
    model_optional |= {"/pooling", "/classify", "/v1/classify"}
    multipart = {"/v1/audio/transcriptions", "/v1/audio/translations"}
    generation = {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
    }
    assert t.proxied == generation | model_optional | multipart and len(t.proxied) == 16
    assert t.model_optional == model_optional
    assert t.multipart == multipart
    assert t.batchable == ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
    assert t.disaggregable == {"/v1/chat/completions", "/v1/completions"}
    gets = {
        "/health": "health",
        "/ready": "ready",
        "/version": "version",
        "/metrics": "metrics",
        "/engines": "engines",
        "/v1/models": "models",
    }
    posts = {"/v1/load_lora_adapter": "lora_fanout", "/v1/unload_lora_adapter": "lora_fanout"}
    assert dict(t.routes) == {"GET": gets, "HEAD": gets, "POST": posts}
    assert t.open == {"/health", "/ready", "/version", "/metrics"}
    assert t.admin == set(posts)
    assert dict(t.allow) == {
        **{path: b"POST" for path in (*posts, *t.proxied)},
        **{path: b"GET, HEAD" for path in gets},
    }
    assert t.batch_roots == ("/v1/files", "/v1/batches")
    assert [t.is_batch(p) for p in ("/v1/files", "/v1/files/f-1/content", "/v1/batches/b/cancel")] == [
        True
    ] * 3
    assert not any(t.is_batch(p) for p in ("/v1/filesx", "/v1/batch", "/v1/models"))
    assert t.probes == {"/health", "/ready"}
    assert t.streamed == {"/v1/files"}
    operations = {path: path.rsplit("/", 1)[-1] for path in t.proxied}
    operations |= {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}
    operations |= {"/v1/embeddings": "embeddings"}
    assert {path: t.operations[path] for path in t.proxied} == operations


def test_every_handler_a_row_names_is_an_endpoint_function() -> None:
    named = {row.handler for row in ENDPOINTS.rows if not row.proxied and row.handler != "batch"}
    for name in named:
        assert inspect.iscoroutinefunction(getattr(endpoints, name)), name


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        ((Endpoint("/v1/x"), Endpoint("/v1/x")), "twice"),
        ((Endpoint("/v1/x", GET),), "POST with a client key"),
        ((Endpoint("/v1/x", auth="open"),), "POST with a client key"),
        ((Endpoint("/x", GET, "open", "health", batchable=True),), "only a proxied endpoint"),
        ((Endpoint("/v1/x", multipart=True, disaggregable=True),), "cannot be disaggregated"),
        ((Endpoint("v1/x"),), "a path from /"),
    ],
)
def test_a_row_the_router_cannot_serve_as_written_is_refused(rows: tuple[Endpoint, ...], says: str) -> None:
    """No column is silently ignored: a row that claims what the router does not do fails at once."""
    with pytest.raises(ValueError, match=says):
        EndpointTable(rows)


# ---- no module keeps its own endpoint set ----------------------------------------------------------------
def _pathlike(node: ast.AST, paths: frozenset[str]) -> bool:
    if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
        return False
    value = node.value
    return value in paths or any(value.startswith(path + "/") for path in paths)


def own_endpoint_facts(source: str, paths: frozenset[str]) -> list[int]:
    """Lines of ``source`` that keep endpoint facts of their own: a set, tuple, list or dict holding one
    of ``paths`` (or a path below one), a comparison with one, or a module-level name for one. An
    engine's URL built from a path (``engine.url + "/v1/models"``: the router calling an engine) is not
    a fact about the router's own endpoints."""
    found: list[int] = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        items: list[ast.AST] = []
        if isinstance(node, ast.Set | ast.Tuple | ast.List):
            items = list(node.elts)
        elif isinstance(node, ast.Dict):
            items = [key for key in node.keys if key is not None]
        elif isinstance(node, ast.Compare):
            items = [node.left, *node.comparators]
        if any(_pathlike(item, paths) for item in items):
            found.append(node.lineno)
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            if _pathlike(node.value, paths):
                found.append(node.lineno)
    return sorted(set(found))


def test_the_scan_finds_a_module_s_own_endpoint_set() -> None:
    source = (
        'PATHS = frozenset({"/v1/completions", "/other"})\n'
        'FILES = "/v1/files"\n'
        "def f(path, engine):\n"
        '    if path == "/health": pass\n'
        '    ok = path.startswith(("/v1/batches/",))\n'
        '    url = engine.url + "/v1/models"\n'
        '    return {"/v1/embeddings": 1}\n'
    )
    assert own_endpoint_facts(source, frozenset(ENDPOINTS.by_path)) == [1, 2, 4, 5, 7]


def test_no_module_keeps_its_own_endpoint_set() -> None:
    """Every path fact comes from the table: a module that lists paths itself again fails here."""
    paths = frozenset(ENDPOINTS.by_path)
    kept = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "endpoint_table.py" and path.parent == PACKAGE:
            continue
        for line in own_endpoint_facts(path.read_text(), paths):
            kept.append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    assert not kept, "endpoint facts outside vllm_stack/endpoint_table.py:\n" + "\n".join(kept)


# ---- a new OpenAI endpoint is one row ---------------------------------------------------------------------
#: The worked example: a new OpenAI endpoint is this one line (docs/architecture.md counts what else it
#: takes: its schema for the fuzz tests). The router's own table is ENDPOINTS plus it.
IMAGES = Endpoint("/v1/images/generations", batchable=True, operation="image_generation")
WITH_IMAGES = ENDPOINTS.plus(IMAGES)


def _router(
    urls: list[str], tmp_path: Path, table: EndpointTable, exporter: InMemorySpanExporter | None = None
) -> Router:
    """A router over ``urls`` serving ``table``, with client keys, the Batch API and tracing on."""
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    settings = {
        **FAST,
        "routing_logic": "roundrobin",
        "static_backends": ",".join(urls),
        "api_keys_file": str(keys),
        "batch_api": True,
        "batch_dir": str(tmp_path / "batch"),
    }
    return build_router(
        settings, environ={}, span_exporter=exporter or InMemorySpanExporter(), endpoints=table
    )


async def test_without_the_row_the_path_is_unknown(tmp_path: Path) -> None:
    async with stubs(StubEngine("a", [MODEL])) as urls:
        router = _router(urls, tmp_path, ENDPOINTS)
        async with serving(router) as url, httpx.AsyncClient(base_url=url, timeout=30) as h:
            r = await h.post(IMAGES.path, json={"model": MODEL}, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


async def test_a_new_openai_endpoint_is_one_row_of_the_table(tmp_path: Path) -> None:
    """``WITH_IMAGES`` is the router's table plus one line; with it the router relays the new path to an
    engine of the model, asks for the client key, answers other methods 405 with ``Allow: POST``, names
    its span ``image_generation``, and runs a batch of it."""
    engine = StubEngine("a", [MODEL])
    exporter = InMemorySpanExporter()
    auth = {"authorization": f"Bearer {KEY}"}
    doc = {"model": MODEL, "prompt": "a lighthouse at dusk"}
    async with stubs(engine) as urls:
        router = _router(urls, tmp_path, WITH_IMAGES, exporter)
        async with serving(router) as url, httpx.AsyncClient(base_url=url, timeout=30) as h:
            await wait_for(lambda: router.registry.healthy_count == 1, what="a healthy engine")
            r = await h.post(IMAGES.path, json=doc, headers=auth)
            assert r.status_code == 200, r.text
            assert r.json() == {"stub": "a", "path": IMAGES.path, "model": MODEL, "engine": "a"}
            assert engine.seen[-1].path == IMAGES.path
            keyless = await h.post(IMAGES.path, json=doc)
            assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "invalid_api_key"
            for method in ("GET", "PUT", "HEAD"):
                wrong = await h.request(method, IMAGES.path, headers=auth)
                assert wrong.status_code == 405 and wrong.headers["allow"] == "POST", method
            assert (await h.get(IMAGES.path, headers=auth)).json()["error"]["code"] == "method_not_allowed"
            h.headers.update(auth)
            line = {"custom_id": "img-0", "method": "POST", "url": IMAGES.path, "body": doc}
            batch = await wait_batch(h, await start_batch(h, [line]), {"completed", "failed"})
            assert batch["status"] == "completed", batch
            (out,) = await file_lines(h, batch["output_file_id"])
            assert out["custom_id"] == "img-0" and out["response"]["body"]["path"] == IMAGES.path
            assert router.tracer is not None
            router.tracer.provider.force_flush()
    names = {
        (s.attributes or {}).get("gen_ai.operation.name")
        for s in exporter.get_finished_spans()
        if s.kind is SpanKind.SERVER and s.name == f"POST {IMAGES.path}"
    }
    assert names == {"image_generation"}


@pytest.mark.parametrize("disaggregable", [True, False])
async def test_a_new_endpoint_is_disaggregated_when_its_row_says_so(disaggregable: bool) -> None:
    """The director reads the same row: with ``disaggregable`` its requests get a prefill leg on a
    prefill engine (one token), without it they go to the decode engine alone."""
    row = Endpoint("/v1/generate", disaggregable=disaggregable)
    prefill, decode = StubEngine("P", [MODEL]), StubEngine("D", [MODEL])
    async with stubs(prefill, decode) as urls:
        cli = {
            **FAST,
            "static_backends": ",".join(urls),
            "routing_logic": "disaggregated_prefill",
            "static_roles": "prefill,decode",
            "disagg_min_uncached_tokens": 64,
        }
        router = build_router(cli, environ={}, endpoints=ENDPOINTS.plus(row))
        async with serving(router) as url, httpx.AsyncClient(base_url=url, timeout=30) as h:
            await wait_for(lambda: router.registry.healthy_count == 2, what="two healthy engines")
            doc = {
                "model": MODEL,
                "prompt": "the quick brown fox jumps over the lazy dog " * 60,
                "max_tokens": 5,
            }
            r = await h.post(row.path, json=doc)
            assert r.status_code == 200 and r.json()["engine"] == "D", r.text
    assert decode.seen[-1].path == row.path
    if disaggregable:
        (p,) = prefill.seen
        assert p.path == row.path and orjson.loads(p.body)["max_tokens"] == 1
    else:
        assert not [s for s in prefill.seen if s.path == row.path]
