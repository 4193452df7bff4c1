"""Every path the router serves, in one table: its methods, who may call it, who answers it, and what
the router does with it (model optional, multipart form, batchable, disaggregable, tracing name).

Each part of the router reads the sets it needs from an :class:`EndpointTable`, computed once when the
table is built (a set or dict lookup per request, never a scan of the rows); no other module lists
paths (``tests/router/test_endpoint_table.py`` fails when one does). A new OpenAI endpoint that an
engine answers is one row here: :data:`ENDPOINTS` gains ``Endpoint("/v1/new")`` and the router proxies
it, answers 405 with ``Allow: POST`` for other methods, traces it as ``new``, and, when ``batchable``,
takes it as a batch's endpoint.

A bottom-layer module (it imports nothing of the router), so the server, tracing and the director read
it as the API layer does. A router is built with the table it serves (:class:`vllm_stack.app.Router`'s
``endpoints``: :data:`ENDPOINTS` unless a test extends it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

#: Who may call an endpoint: anyone (probes, metrics), a client API key (when keys are configured), or
#: an admin key (checked by its handler, which refuses when no admin key is configured).
#: ``admin_if_keys``: an admin key when admin keys are configured, else a client key when client keys are,
#: open only without any key (production-stack's sleep endpoints are open; checked by the route table).
Auth = Literal["open", "client", "admin", "admin_if_keys"]

PROXY = ""  # an endpoint's ``handler`` when an engine of the request's model answers it
BATCH = "batch"  # ... when the Batch API answers it (and the paths below it: its objects)

POST: tuple[str, ...] = ("POST",)
GET: tuple[str, ...] = ("GET", "HEAD")  # a GET route answers HEAD the same way


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One path and what the router does with it."""

    path: str
    methods: tuple[str, ...] = POST
    auth: Auth = "client"
    #: :data:`PROXY` (sent to an engine of the request's model), :data:`BATCH`, or the name of the
    #: function in :mod:`vllm_stack.api.endpoints` that answers it.
    handler: str = PROXY
    model_optional: bool = False  # vLLM uses its only base model when the body names none
    multipart: bool = False  # a multipart/form-data body (its ``model`` is a form field)
    batchable: bool = False  # a batch's ``endpoint`` may name it
    disaggregable: bool = False  # a request may be prefilled on another engine (prompt, max_tokens)
    #: A stream broken by its engine may go on on another (director.continuation): "chat" (the text as
    #: a partial assistant message) or "prompt" (the text after the prompt); "" for none
    continuation: str = ""
    #: The span's ``gen_ai.operation.name`` (OpenTelemetry's GenAI conventions); default the last segment.
    operation: str = ""
    probe: bool = False  # answered even on a connection past the connection limit
    streamed: bool = False  # a POST body is handed over as it arrives (a batch file upload), not buffered

    @property
    def proxied(self) -> bool:
        return self.handler == PROXY

    @property
    def allow(self) -> str:
        """The ``Allow`` header of its 405 (RFC 9110 15.5.6)."""
        return ", ".join(self.methods)


class EndpointTable:
    """The rows and every set the router reads of them, computed here once."""

    def __init__(self, rows: Iterable[Endpoint]) -> None:
        self.rows: tuple[Endpoint, ...] = tuple(rows)
        by_path: dict[str, Endpoint] = {}
        for row in self.rows:
            if row.path in by_path:
                raise ValueError(f"endpoint {row.path} is in the table twice")
            _check(row)
            by_path[row.path] = row
        self.by_path: Mapping[str, Endpoint] = MappingProxyType(by_path)
        proxied = [r for r in self.rows if r.proxied]
        answered = [r for r in self.rows if not r.proxied and r.handler != BATCH]
        batch = [r for r in self.rows if r.handler == BATCH]
        #: POSTed to an engine of the request's model (the hot path).
        self.proxied = frozenset(r.path for r in proxied)
        self.model_optional = frozenset(r.path for r in proxied if r.model_optional)
        self.multipart = frozenset(r.path for r in proxied if r.multipart)
        self.batchable = tuple(r.path for r in proxied if r.batchable)  # in the table's order (messages)
        self.disaggregable = frozenset(r.path for r in proxied if r.disaggregable)
        self.continuable: Mapping[str, str] = MappingProxyType(
            {r.path: r.continuation for r in proxied if r.continuation}
        )
        #: The router's own endpoints: method -> path -> handler name (HEAD as GET).
        routes: dict[str, dict[str, str]] = {}
        for row in answered:
            for method in row.methods:
                routes.setdefault(method, {})[row.path] = row.handler
        self.routes: Mapping[str, Mapping[str, str]] = MappingProxyType(
            {method: MappingProxyType(paths) for method, paths in routes.items()}
        )
        self.open = frozenset(r.path for r in answered if r.auth == "open")
        self.admin = frozenset(r.path for r in answered if r.auth == "admin")
        self.admin_if_keys = frozenset(r.path for r in answered if r.auth == "admin_if_keys")
        #: The 405's ``Allow`` of every path but the Batch API's (whose handler knows its objects' methods).
        self.allow: Mapping[str, bytes] = MappingProxyType(
            {r.path: r.allow.encode() for r in (*proxied, *answered)}
        )
        self.batch_roots = tuple(r.path for r in batch)
        self.batch_prefixes = tuple(r.path + "/" for r in batch)
        self.probes = frozenset(r.path for r in self.rows if r.probe)
        self.streamed = frozenset(r.path for r in self.rows if r.streamed)
        self.operations: Mapping[str, str] = MappingProxyType(
            {r.path: r.operation or r.path.rsplit("/", 1)[-1] for r in self.rows}
        )

    def is_batch(self, path: str) -> bool:
        """A Batch API path: a root (``/v1/files``) or one of its objects (``/v1/files/ID/content``)."""
        return path in self.batch_roots or path.startswith(self.batch_prefixes)

    def plus(self, *rows: Endpoint) -> EndpointTable:
        """This table with ``rows`` added (a test's new endpoint)."""
        return EndpointTable((*self.rows, *rows))


def _check(row: Endpoint) -> None:
    """Refuse a row that claims what the router does not do with such an endpoint, so that no column
    is silently ignored: the proxied path takes POSTs with a client key; the router's own endpoints and
    the Batch API's are not parsed for a model, batched or disaggregated."""
    if not row.path.startswith("/") or not row.methods:
        raise ValueError(f"endpoint {row.path!r}: a path from / and at least one method")
    if row.proxied:
        if row.methods != POST or row.auth != "client" or row.probe or row.streamed:
            raise ValueError(f"proxied endpoint {row.path}: POST with a client key only")
    elif row.model_optional or row.multipart or row.batchable or row.disaggregable:
        raise ValueError(
            f"endpoint {row.path}: only a proxied endpoint reads a model, batches or disaggregates"
        )
    if row.disaggregable and row.multipart:
        raise ValueError(f"endpoint {row.path}: a multipart body cannot be disaggregated")
    if row.streamed and row.handler != BATCH:
        raise ValueError(f"endpoint {row.path}: only the Batch API's uploads are streamed")


#: The router's endpoints (vLLM's OpenAI-compatible server's, the router's own, and the Batch API's).
ENDPOINTS = EndpointTable(
    (
        # Sent to an engine of the request's model.
        Endpoint(
            "/v1/chat/completions", batchable=True, disaggregable=True, operation="chat", continuation="chat"
        ),
        Endpoint(
            "/v1/completions",
            batchable=True,
            disaggregable=True,
            operation="text_completion",
            continuation="prompt",
        ),
        Endpoint("/v1/embeddings", batchable=True, operation="embeddings"),
        Endpoint("/v1/responses"),
        Endpoint("/v1/messages"),
        Endpoint("/v1/rerank", model_optional=True),
        Endpoint("/rerank", model_optional=True),
        Endpoint("/v1/score", model_optional=True),
        Endpoint("/score", model_optional=True),
        Endpoint("/tokenize", model_optional=True),
        Endpoint("/detokenize", model_optional=True),
        Endpoint("/v1/audio/transcriptions", multipart=True),
        Endpoint("/v1/audio/translations", multipart=True),
        Endpoint("/pooling", model_optional=True),
        Endpoint("/classify", model_optional=True),
        Endpoint("/v1/classify", model_optional=True),
        # Answered by the router (vllm_stack.api.endpoints).
        Endpoint("/health", GET, "open", "health", probe=True),
        Endpoint("/ready", GET, "open", "ready", probe=True),
        Endpoint("/version", GET, "open", "version"),
        Endpoint("/metrics", GET, "open", "metrics"),
        Endpoint("/engines", GET, "client", "engines"),
        Endpoint("/v1/models", GET, "client", "models"),
        Endpoint("/v1/load_lora_adapter", POST, "admin", "lora_fanout"),
        Endpoint("/v1/unload_lora_adapter", POST, "admin", "lora_fanout"),
        # vLLM's sleep mode, sent to the engine named by ?id= (production-stack's engine id).
        Endpoint("/sleep", POST, "admin_if_keys", "sleep_control"),
        Endpoint("/wake_up", POST, "admin_if_keys", "sleep_control"),
        Endpoint("/is_sleeping", GET, "admin_if_keys", "sleep_control"),
        # The Batch API (vllm_stack.batch.api: it answers the paths below these too, and their methods).
        Endpoint("/v1/files", ("GET", "HEAD", "POST"), "client", BATCH, streamed=True),
        Endpoint("/v1/batches", ("GET", "HEAD", "POST"), "client", BATCH),
    )
)
