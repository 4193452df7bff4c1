"""External providers beside whatever discovery finds: every snapshot gets their endpoints appended.

Providers are fixed at start (the file is read once), so they are not a discovery source of their own:
they ride along each snapshot of the real source (static, Kubernetes, or none at all with
``--service-discovery external-only``), and the registry never sees them leave.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_stack.engines.discovery.base import EndpointInfo, SnapshotSink
from vllm_stack.engines.external import ExternalProvider


def provider_endpoints(providers: Sequence[ExternalProvider]) -> list[EndpointInfo]:
    """One endpoint per provider, of the engine kind its ``type`` names."""
    return [EndpointInfo(name=p.engine_name, url=p.api_base, kind="openai") for p in providers]


def with_providers(sink: SnapshotSink, providers: Sequence[ExternalProvider]) -> SnapshotSink:
    """``sink`` receiving each snapshot with the providers' endpoints appended (``sink`` itself when
    there are none, so a router without providers runs exactly as before)."""
    if not providers:
        return sink
    extra = provider_endpoints(providers)

    async def appended(endpoints: list[EndpointInfo]) -> None:
        await sink([*endpoints, *extra])

    return appended
