"""Tenants (docs/tenants.md): how a request's tenant is named, and the declared tenants."""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_stack.settings.declare import ConfigError, setting
from vllm_stack.tenants.declaration import TenantTable
from vllm_stack.tenants.identity import FAIRNESS_HEADER

#: An HTTP field name (RFC 9110's token): what a request's header can be called, ASCII only.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


@dataclass(frozen=True)
class TenantsGroup:
    """Who sent a request when no client key names it, and what each declared tenant is given. The
    declaration is read from the file as a configuration is loaded, so a reload applies its changes."""

    __slots__ = ()

    tenant_header: str = setting(
        FAIRNESS_HEADER,
        doc="the header naming a request's tenant when no client keys are configured "
        "(with llm-d's default, its alias x-gateway-inference-fairness-id is read too; another header is the "
        "only one read)",
        chart="routerSpec.tenantHeader",
    )
    tenants_file: str | None = setting(
        None,
        doc="the tenants declaration: YAML {tenants: [{name, weight, requests_per_minute, "
        "tokens_per_minute}]} (docs/tenants.md)",
        chart="routerSpec.tenants",
    )
    tenant_headroom_slots: int = setting(
        1,
        doc="running slots per engine kept free of a tenant holding more than its share while another "
        "tenant is active (0: none)",
        flag="",
        chart="routerSpec.tenantHeadroomSlots",
    )
    tenant_share_seconds: float = setting(
        5.0,
        doc="the time constant over which a tenant's requests on a model's engines are averaged before "
        "they are measured against its share of the slots, so a tenant within its share is not held back "
        "when its arrivals bunch up for a moment (0: the count of the moment)",
        flag="",
        chart="routerSpec.tenantShareSeconds",
    )
    tenants: TenantTable = setting(
        factory=TenantTable,
        doc="the declared tenants, read from tenants_file",
        flag="",
        in_file=False,
    )

    def check(self) -> None:
        """Raise :class:`ConfigError` on a ``tenant_header`` that is not a header name: checked with the
        other settings, before a reload applies anything (it would otherwise fail as the tenant identity
        is built, after the scheduling was swapped: a half-applied reload). A bad tenants file fails as
        it is read."""
        if self.tenant_headroom_slots < 0:
            raise ConfigError("tenant_headroom_slots must be >= 0")
        if not self.tenant_share_seconds >= 0:  # (NaN too)
            raise ConfigError("tenant_share_seconds must be >= 0")
        if _HEADER_NAME.fullmatch(self.tenant_header) is None:
            raise ConfigError(
                f"tenant_header must be a header name (RFC 9110 token), not {self.tenant_header!r}"
            )
