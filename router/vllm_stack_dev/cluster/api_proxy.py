"""A pass-through HTTPS proxy in front of the test cluster's API server that can hold a client's next watch.

Why: a watch from an expired resourceVersion (410 Gone) happens in a cluster when a client's list and its
watch are separated by an etcd compaction: a slow client, a long GC pause, a network stall. The router
re-lists before every watch, so against a healthy API server the window is a few milliseconds and cannot
be hit on purpose. Through this proxy a test widens that window: the router's next watch request is held
(its list has passed), the test changes Pods and compacts etcd past the list's resourceVersion, then lets
the watch go on; the real API server (without a watch cache, so the watch goes to etcd) answers it as it
answers any watch from a compacted revision. Nothing is forged: every byte the client reads is the API
server's. The proxy also cuts open watches on demand (a dropped connection), to make the router re-list.

It terminates TLS with a certificate of its own CA (the client's kubeconfig trusts that CA) and forwards
each request with the client's own `Authorization` header, so the API server authenticates and
authorizes the client (a ServiceAccount token), not the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import threading
import urllib.request
from pathlib import Path

import aiohttp
from aiohttp import web

from vllm_stack_dev.cluster.control_plane import LOOPBACK, Cluster
from vllm_stack_dev.cluster.kubeconfig import write_token_kubeconfig
from vllm_stack_dev.cluster.pki import make_tls_bundle
from vllm_stack_dev.testbed.engines import port_for_later

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "upgrade", "host", "content-length"}


class ApiProxy:
    """Runs in a thread of its own (its own event loop); :meth:`close` stops it."""

    def __init__(self, cluster: Cluster, workdir: Path) -> None:
        assert cluster.pki is not None
        self.cluster = cluster
        self.port = port_for_later()
        self.url = f"https://{LOOPBACK}:{self.port}"
        self.certs = make_tls_bundle(workdir / "api-proxy-certs", names=("localhost",), ips=(LOOPBACK,))
        self._upstream_ssl = ssl.create_default_context(cafile=str(cluster.pki.ca.cert))
        self._hold_next_watch = threading.Event()
        self.held = threading.Event()  # set while a watch is held
        self._release = threading.Event()
        self._watches: set[asyncio.BaseTransport] = set()  # connections with a watch stream open
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="api-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the API proxy did not start")

    # ---- controls (from the test's thread) -------------------------------------------------------------
    def kubeconfig(self, token: str, namespace: str, path: Path) -> Path:
        """A kubeconfig for ``token`` that reaches the API server through this proxy."""
        return write_token_kubeconfig(path, self.url, self.certs / "ca.crt", token, namespace)

    def hold_next_watch(self) -> None:
        """The next watch request waits here, unanswered, until :meth:`release` (``held`` says when)."""
        self._release.clear()
        self.held.clear()
        self._hold_next_watch.set()

    def release(self) -> None:
        self._release.set()

    def cut_watches(self) -> None:
        """End every watch stream open through the proxy, as a dropped connection would."""
        future = asyncio.run_coroutine_threadsafe(self._cut(), self._loop)
        future.result(timeout=10)

    def close(self) -> None:
        self._release.set()
        with contextlib.suppress(Exception):  # the loop may be gone already
            asyncio.run_coroutine_threadsafe(self._cancel_handlers(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _cancel_handlers(self) -> None:
        """End the requests still being served (open watches), so that none is left pending at exit."""
        current = asyncio.current_task()
        handlers = [task for task in asyncio.all_tasks() if task is not current]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    # ---- the server (in its thread) --------------------------------------------------------------------
    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        runner = self._loop.run_until_complete(self._start())
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._session.close())
            self._loop.run_until_complete(runner.cleanup())

    async def _start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(self.certs / "tls.crt"), str(self.certs / "tls.key"))
        await web.TCPSite(runner, LOOPBACK, self.port, ssl_context=context).start()
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._upstream_ssl))
        return runner

    async def _cut(self) -> None:
        for transport in list(self._watches):
            transport.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        is_watch = request.query.get("watch", "").lower() in ("true", "1")
        if is_watch and self._hold_next_watch.is_set():
            self._hold_next_watch.clear()
            self.held.set()
            await asyncio.get_running_loop().run_in_executor(None, self._release.wait)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        body = await request.read()
        try:
            upstream = await self._session.request(
                request.method, self.cluster.server + request.rel_url.human_repr(), headers=headers,
                data=body or None, timeout=aiohttp.ClientTimeout(total=None, sock_read=None),
            )  # fmt: skip
        except (OSError, aiohttp.ClientError):
            # The API server is away (a test restarts it): the client's connection is dropped, as it would
            # be without the proxy, rather than answered with a status the API server never sent.
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=502)  # never written: the connection is gone
        response = web.StreamResponse(
            status=upstream.status,
            headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP},
        )
        await response.prepare(request)
        transport = request.transport if is_watch else None
        if transport is not None:
            self._watches.add(transport)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (ConnectionResetError, aiohttp.ClientError):
            # The client or the API server went away mid-stream: drop the client's connection too (a
            # clean end would tell the client the server ended the watch on purpose).
            if request.transport is not None:
                request.transport.abort()
        finally:
            if transport is not None:
                self._watches.discard(transport)
            upstream.release()
        return response


def compact_etcd(cluster: Cluster) -> int:
    """Compact etcd at its current revision (what kube-apiserver does every 5 minutes); the revision.

    Through etcd's JSON gateway on its client URL: a range read for the current revision, then a physical
    compaction at it. Every watch from an older revision is then answered 410 Gone by an API server
    without a watch cache."""
    base = f"http://{LOOPBACK}:{cluster.etcd_port}/v3/kv"

    def post(path: str, doc: dict) -> dict:
        request = urllib.request.Request(
            f"{base}/{path}", data=json.dumps(doc).encode(), headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    revision = int(post("range", {"key": "AA=="})["header"]["revision"])  # any key: the header says
    post("compaction", {"revision": str(revision), "physical": True})
    return revision
