"""One ext_proc stream (one gateway request): the messages in, the answers out, in the protocol's order.

The request is judged on its headers first, as the router judges its own on their head: the client key,
then the path (:mod:`.paths`: the router's proxied paths and GET routes; anything else its 404/405), and a
body that comes before any headers is never picked. Its headers and body chunks are then gathered until
the body's end (bounded by the router's body limits, and in time by the server's sweep); then the request goes through the same parsing as the router's own (:func:`vllm_stack.api.
proxied.resolve`) and the director's stages (:class:`~.request.PickedRequest`). The answer to the
request headers (the picked endpoint, as a header and as ``envoy.lb`` metadata with fallbacks after it)
and the body (as the engine must get it: a weighted name's target, the engine priority field) follow, or
one ImmediateResponse with the router's OpenAI-style error. The response's headers and body chunks are
passed back as they come; their end settles the engine's booking and runs the completion hooks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from vllm_stack.api.head import unauthorized
from vllm_stack.api.proxied import provider_body, resolve
from vllm_stack.epp.paths import headerless, refusal
from vllm_stack.epp.request import PickedRequest
from vllm_stack.errors import RouterError, error_body, no_healthy_engine
from vllm_stack.extproc import wire
from vllm_stack.relay.headers import header_fields
from vllm_stack.relay.leg import ANSWER_END_BYTES
from vllm_stack.request_id import new_request_id, valid_request_id

if TYPE_CHECKING:
    from vllm_stack.api.state import RouterState
    from vllm_stack.engines.engine import Engine
    from vllm_stack.epp.inference_objects import Objectives
    from vllm_stack.epp.limits import PickerLimits
    from vllm_stack.epp.slots import StreamSlots
    from vllm_stack.metrics import RouterMetrics

log = logging.getLogger(__name__)

Responses = list[wire.ProcessingResponse]


class StreamService(Protocol):
    """What a stream reads of the gRPC service that opened it (:class:`~.server.PickerService`, which
    imports this module: named here by what is read, so the import runs one way)."""

    router: RouterState
    metrics: RouterMetrics
    objectives: Objectives
    limits: PickerLimits
    slots: StreamSlots
    fallbacks: int  # endpoints listed after the picked one

    def reserve(self, size: int) -> bool:
        """Take ``size`` bytes of the bodies' budget; False when it is spent."""
        ...

    def release(self, size: int) -> None:
        """Give back ``size`` bytes of the bodies' budget."""
        ...


def _lines(block: bytes) -> Iterable[tuple[str, str]]:
    """``name: value`` pairs of header lines (what pre-request plugins add upstream)."""
    for name, value in header_fields(block):
        yield name.decode("latin-1").lower(), value.decode("latin-1")


class Exchange:
    """The state of one stream; :meth:`receive` takes each message and gives the answers to send."""

    __slots__ = (
        "service",
        "router",
        "headers",
        "chunks",
        "size",
        "reserved",
        "subset",
        "request",
        "answer",
        "status",
        "answer_tail",
        "closed",
        "heard_headers",
        "waiting_request",
        "task",
        "reading",
        "since",
        "evicted",
        "expired",
    )

    def __init__(self, service: StreamService, task: asyncio.Task[Any] | None) -> None:
        self.service = service
        self.router: RouterState = service.router
        self.headers: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.reserved = 0  # bytes of the service's body budget this stream holds
        self.subset: list[str] | None = None
        self.request: PickedRequest | None = None
        # resolved by the request: the answers to the request's end, or the refusal
        self.answer: asyncio.Future[Responses] | None = None
        self.status = 200
        self.answer_tail = b""
        self.closed = False  # an ImmediateResponse was sent: the stream ends
        self.heard_headers = False  # the request's headers came (and passed the key check)
        # the request is still arriving (headers, body chunks): its silence is the idle timeout's, and
        # at the stream cap it may give way to a new stream (.slots); False from the pick (or the
        # answer at once) on, when the engine's answer is what the stream waits for
        self.waiting_request = True
        self.task = task  # the gRPC handler's, which reads the stream's messages (None once ended)
        self.reading = False  # the task waits for the stream's next message
        self.since = 0.0  # ... since then (time.monotonic)
        self.evicted = False  # a new stream took this one's place (.slots): answered 408
        self.expired = False  # the read was cancelled for silence (or eviction)

    # ---- messages in --------------------------------------------------------------------------------
    async def receive(self, message: wire.ProcessingRequest) -> Responses:
        kind = message.WhichOneof("request")
        subset = wire.subset_hint(message)
        if subset is not None:  # the latest message's hint counts (the body's end carries it)
            self.subset = subset
        if kind == "request_headers":
            self.headers = wire.headers_of(message.request_headers)
            auth = self.router.auth
            if auth.enabled and not auth.check(
                (name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers
            ):  # judged on the headers, as the router's own requests are: no body is gathered for it
                return self._refuse_early(unauthorized())
            error = refusal(self.router.endpoints, self.headers)
            if error is not None:
                return self._refuse_early(error)
            self.heard_headers = True
            if message.request_headers.end_of_stream:
                return self._header_only()
            return []
        if not self.heard_headers and kind in ("request_body", "request_trailers"):
            # a body before any headers: nothing to check a key on, so nothing may be picked for it
            return self._refuse_early(headerless(self.router.auth.enabled))
        if kind == "request_body":
            body = message.request_body
            if body.body:
                error = self._gather(body.body)
                if error is not None:
                    return self._refuse(error, "immediate")
            if body.end_of_stream:
                if self.request is not None or self.answer is not None:  # a second end: not the protocol
                    self.service.metrics.ext_proc_streams.child("protocol_error").inc()
                    return []
                return await self._pick()
            return []
        if kind == "request_trailers":  # a body ended by trailers: its end is here
            return await self._pick() if self.request is None and self.answer is None else []
        if kind == "response_headers":
            served = wire.served_endpoint(message)
            if served is not None:
                self._served(served)
            return self._response_headers(message.response_headers)
        if kind == "response_body":
            return self._response_body(message.response_body.body, message.response_body.end_of_stream)
        if kind == "response_trailers":
            self._answered()
            return [wire.ProcessingResponse(response_trailers=wire.pb.TrailersResponse())]
        self.service.metrics.ext_proc_streams.child("protocol_error").inc()
        return []

    # ---- silence ------------------------------------------------------------------------------------
    def listen(self, now: float) -> None:
        """The stream's task is about to wait for its next message: silence counts from ``now``."""
        self.since = now
        self.reading = True
        if self.waiting_request:
            self.service.slots.heard(self, now)

    def silence_allowed(self) -> float:
        """Seconds the stream's next message may take: the idle timeout while its request arrives, the
        answer timeout after the pick."""
        limits = self.service.limits
        return limits.idle_timeout if self.waiting_request else limits.answer_timeout

    def overdue(self, now: float) -> bool:
        return self.reading and now - self.since >= self.silence_allowed()

    def expire(self) -> bool:
        """End the wait for the next message: the read is cancelled, only while the task waits in it, so
        the cancellation surfaces there and nowhere else (the handler then calls :meth:`silent`). False
        when the task is not waiting there (then nothing is done)."""
        if not self.reading or self.expired:
            return False
        self.expired = True
        if self.task is not None:
            self.task.cancel()
        return True

    def evict(self) -> bool:
        """A new stream takes this one's place (:mod:`.slots`), which waits for its request's next part."""
        self.evicted = self.expire()
        return self.evicted

    def silent(self) -> Responses:
        """The wait for the next message was ended. A request still arriving is answered 408, its body's
        budget given back; a picked request's engine booking is released (the engine may still be
        answering: the gateway's own timeout decides what its client gets), and nothing is answered:
        the caller ends the stream with an error."""
        if self.waiting_request:
            if self.evicted:
                error = RouterError(
                    408,
                    "The request stalled while the endpoint picker was full; its place went to another.",
                    code="request_timeout",
                )
                return self._refuse(error, "evicted")
            error = RouterError(
                408,
                f"No part of the request arrived for {self.silence_allowed():g}s.",
                code="request_timeout",
            )
            return self._refuse(error, "idle_timeout")
        request = self.request
        if request is not None and not request.done:
            self.service.metrics.ext_proc_streams.child("answer_timeout").inc()
            request.lost("answer_timeout")
        return []

    def _request_complete(self) -> None:
        """Picked, or answered at once: the stream now waits on the answer, not on its request."""
        if self.waiting_request:
            self.waiting_request = False
            self.service.slots.settled(self)

    def _refuse_early(self, error: RouterError) -> Responses:
        """A refusal before any parsing (the key, the path, the protocol), counted as the router's are."""
        self.router.metrics.observe_request("unknown", "none", str(error.status), 0.0)
        return self._refuse(error, "immediate")

    def _gather(self, chunk: bytes) -> RouterError | None:
        limit = self.router.max_body_bytes
        if self.size + len(chunk) > limit:
            return RouterError(413, f"The request body exceeds {limit} bytes.", code="body_too_large")
        if not self.service.reserve(len(chunk)):
            return RouterError(
                503,
                "The endpoint picker holds as many request bodies as it may; try again shortly.",
                code="body_buffers_full",
                headers=[(b"retry-after", b"1")],
            )
        self.reserved += len(chunk)
        self.chunks.append(chunk)
        self.size += len(chunk)
        return None

    def _release_body(self) -> None:
        if self.reserved:
            self.service.release(self.reserved)
            self.reserved = 0
        self.chunks = []

    # ---- the pick -----------------------------------------------------------------------------------
    async def _pick(self) -> Responses:
        self._request_complete()
        router = self.router
        started = time.perf_counter()
        body = b"".join(self.chunks)
        self._release_body()
        headers = self.headers
        wanted = {
            "content-type": b"",
            router.session_header.decode(): None,
            router.priority.header.decode(): None,
        }
        request_id = b""
        invalid_id = False
        raw: list[tuple[bytes, bytes]] = []
        path = "/v1/completions"
        objective = ""
        for name, value in headers:
            if name in wanted:
                wanted[name] = value.encode("latin-1")
            if name == ":path":
                path = value.partition("?")[0]
            elif name == "x-request-id":
                if not valid_request_id(value.encode("latin-1")):
                    invalid_id = True  # dropped below, never passed on
                    continue
                request_id = value.encode("latin-1")
            elif name == wire.OBJECTIVE_HEADER:
                objective = value
            if not name.startswith(":"):
                raw.append((name.encode("latin-1"), value.encode("latin-1")))
        if invalid_id:  # the router's rule (api.proxied.handle): only a valid client id is used
            self.headers = headers = [
                (n, v) for n, v in headers if n != "x-request-id" or valid_request_id(v.encode("latin-1"))
            ]
        if not request_id:
            request_id = new_request_id()
            headers.append(("x-request-id", request_id.decode()))
        session = wanted[router.session_header.decode()]
        priority = wanted[router.priority.header.decode()]
        try:
            ctx = resolve(router, path, body, wanted["content-type"] or b"", session, priority, raw)
            ctx.body = provider_body(router, ctx)  # an alias: the provider's own id (every leg)
        except RouterError as error:
            router.metrics.observe_request(
                "unknown", "none", str(error.status), time.perf_counter() - started
            )
            return self._refuse(error, "immediate")
        ctx.request_id = request_id
        ctx.arrived = started
        if objective:
            given = ctx.priority
            ctx.priority = self.service.objectives.priority(objective, given)
            if ctx.priority != given and path not in router.endpoints.multipart:
                # the engines get it too where they schedule by it (resolve wrote the request's own)
                ctx.body = router.priority.engine_body(
                    ctx.pool or ctx.model, ctx.priority, ctx.body, -given if given else None
                )
        if self.subset is not None:
            ctx.excluded = self._outside(self.subset, ctx.pool or ctx.model)
        self.answer = asyncio.get_running_loop().create_future()
        self.request = PickedRequest(router.director, ctx, self)  # runs the stages
        return await self.answer

    def _outside(self, subset: list[str], model: str) -> set[str]:
        """The model's engines the subset hint leaves out (an item without a port allows every port)."""
        allowed = set(subset)
        return {e.name for e in self.router.registry.candidates(model) if not _in_subset(e, allowed)}

    def _header_only(self) -> Responses:
        """A request without a body (a GET): any healthy engine, the least busy, no scheduling."""
        self._request_complete()
        engines = [e for e in self.router.registry.engines() if e.routable()]
        if self.subset is not None:
            allowed = set(self.subset)
            engines = [e for e in engines if _in_subset(e, allowed)]
        if not engines:
            return self._refuse(no_healthy_engine("any"), "immediate")
        engine = min(engines, key=lambda e: e.in_flight)
        self.service.metrics.ext_proc_streams.child("header_only").inc()
        endpoint = engine.address
        return [wire.destination_answer([(wire.DESTINATION_HEADER, endpoint)], endpoint)]

    # ---- what the request reports (PickListener) ----------------------------------------------------
    def picked(self, request: PickedRequest) -> None:
        engine = request.engine
        assert engine is not None
        ctx = request.ctx
        endpoint = engine.address
        fallbacks = [
            e.address
            for e in sorted(self.router.registry.candidates(ctx.pool or ctx.model), key=lambda e: e.in_flight)
            if e is not engine and e.name not in ctx.excluded and e.routable() and e.breaker.available()
        ][: self.service.fallbacks]
        listed = ",".join([endpoint, *fallbacks])
        body = ctx.body
        pairs = [(wire.DESTINATION_HEADER, endpoint), ("Content-Length", str(len(body)))]
        auth = self.router.director.settings.engine_auth
        if auth:
            pairs.append(("authorization", auth.decode("latin-1")))
        if ctx.upstream_headers:
            pairs += _lines(ctx.upstream_headers)
        owned = {name.lower() for name, _ in pairs}
        pairs += [
            (name, value)
            for name, value in self.headers
            if name not in wire.SYSTEM_HEADERS and name not in owned and name != "authorization"
        ]
        answers = [wire.destination_answer(pairs, listed)]
        answers += [wire.streamed_body("request_body", chunk, eos) for chunk, eos in wire.body_chunks(body)]
        self.service.metrics.ext_proc_streams.child("picked").inc()
        self._resolve(answers)

    def refused(self, error: RouterError) -> None:
        self._resolve(self._refuse(error, "immediate"))

    def _resolve(self, answers: Responses) -> None:
        answer = self.answer
        if answer is not None and not answer.done():
            answer.set_result(answers)

    def _refuse(self, error: RouterError, outcome: str) -> Responses:
        self._request_complete()
        self._release_body()
        self.closed = True
        self.service.metrics.ext_proc_streams.child(outcome).inc()
        headers = [("content-type", "application/json"), ("x-vllm-stack-error", error.marker().decode())]
        headers += [(k.decode("latin-1"), v.decode("latin-1")) for k, v in error.headers]
        body = error_body(error.status, error.message, code=error.code, param=error.param)
        return [wire.immediate(error.status, body, headers)]

    # ---- the answer ---------------------------------------------------------------------------------
    def _served(self, endpoint: str) -> None:
        """The gateway's ``x-gateway-destination-endpoint-served``: the engine the answer comes from."""
        request = self.request
        if request is None or request.engine is None or request.engine.address == endpoint:
            return
        ctx = request.ctx
        engine = self.router.registry.candidate_at(ctx.pool or ctx.model, endpoint)
        if engine is not None:
            request.served_by(engine)

    def _response_headers(self, message: Any) -> Responses:  # noqa: ANN401 - wire.pb.HttpHeaders
        echoed = []
        for name, value in wire.headers_of(message):
            if name in (":status", "status"):
                try:
                    self.status = int(value)
                except ValueError:
                    self.status = 502
            if name not in wire.SYSTEM_HEADERS:
                echoed.append((name, value))
        if message.end_of_stream:  # an answer without a body
            self._answered()
        mutation = wire.set_headers([(wire.RESPONSE_MARK, "true"), *echoed])
        return [
            wire.ProcessingResponse(
                response_headers=wire.pb.HeadersResponse(
                    response=wire.pb.CommonResponse(header_mutation=mutation)
                )
            )
        ]

    def _response_body(self, chunk: bytes, end_of_stream: bool) -> Responses:
        request = self.request
        if request is not None and chunk:
            request.first_byte()
            tail = self.answer_tail + chunk
            self.answer_tail = tail[-ANSWER_END_BYTES:]
        if end_of_stream:
            self._answered()
        return [
            wire.streamed_body("response_body", part, eos)
            for part, eos in wire.body_chunks(chunk, end_of_stream)
        ]

    def _answered(self) -> None:
        request = self.request
        if request is not None:
            request.answered(self.status, self.answer_tail)

    def end(self) -> None:
        """The stream is over (the gateway closed it, or it broke): whatever is still open is released."""
        self._release_body()
        request = self.request
        if request is not None and not request.done:
            if request.engine is None:
                self.service.metrics.ext_proc_streams.child("aborted").inc()
            request.lost()
        answer = self.answer
        if answer is not None and not answer.done():
            answer.cancel()
        # The exchange refers to its request, which refers back to it (its listener), and to the task
        # whose frames refer to it: cycles that only the garbage collector would free, a few dozen
        # objects per stream kept alive until the next collection, whose cost grows with them.
        self.request = None
        self.answer = None
        self.task = None


def _in_subset(engine: Engine, allowed: set[str]) -> bool:
    """Whether a subset hint allows ``engine``: its ``host:port``, or its host alone (any port)."""
    address = engine.address
    return address in allowed or address.rpartition(":")[0] in allowed
