"""The endpoint table (vllm_stack.endpoint_table) is the one place that lists the router's paths: the
sets every part reads are derived from it (and are the sets the router had before the table), and no
module of the router keeps a set of its own.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from vllm_stack.api import endpoints
from vllm_stack.endpoint_table import ENDPOINTS, GET, Endpoint, EndpointTable

PACKAGE = Path(__file__).resolve().parents[2] / "router" / "vllm_stack"


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
