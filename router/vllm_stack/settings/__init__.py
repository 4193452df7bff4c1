"""Every router setting, declared once, in groups by component.

Each group (a module here) is a frozen dataclass of fields made with :func:`setting`: the default, and
beside it the flag, the ``--help`` text, the reload rule (``restart=`` why the running router keeps its
start value; none: a reload applies it), the Helm value the chart renders it from, an environment
variable. Each group checks its own fields (``check``). ``vllm_stack.config.RouterConfig`` is all the
groups in one flat, slotted object, so the code that reads ``config.port`` on the request path reads a
plain attribute, as before.

Derived from the declaration, never written by hand: the command line
(``vllm_stack.router_cli.build_parser``), the reload rule (``vllm_stack.app.RESTART_ONLY``), the
chart's table of this router's flags (``ours`` in ``helm/files/router-flags.yaml``) and the settings
table ``docs/settings.md``; ``python -m vllm_stack_dev.settings_docs`` writes the two files and
``tests/router/test_settings_declared.py`` fails when any of the four disagrees with the declaration.

A new setting: one field in its group (and its ``check`` line when it has a bound), the code that
reads it, a test, then ``python -m vllm_stack_dev.settings_docs``. A reload that must not apply it
needs ``restart=``; one that applies it needs a probe in ``tests/router/test_reload.py``. A new group:
a module here, and a base of ``RouterConfig``.
"""

from __future__ import annotations

from vllm_stack.settings.auth import AuthGroup
from vllm_stack.settings.batch import BatchGroup
from vllm_stack.settings.declare import ConfigError, Declared, Setting, declared, setting
from vllm_stack.settings.disagg import DisaggGroup
from vllm_stack.settings.discovery import DiscoveryGroup
from vllm_stack.settings.engines import EngineGroup
from vllm_stack.settings.eviction import EvictionGroup
from vllm_stack.settings.gateway import GatewayGroup
from vllm_stack.settings.priority import PriorityGroup
from vllm_stack.settings.ratelimit import RateLimitGroup
from vllm_stack.settings.scheduling import SchedulingGroup
from vllm_stack.settings.server import ServerGroup
from vllm_stack.settings.tenants import TenantsGroup
from vllm_stack.settings.tracing import TracingGroup

__all__ = [
    "AuthGroup",
    "BatchGroup",
    "ConfigError",
    "Declared",
    "DiscoveryGroup",
    "DisaggGroup",
    "EngineGroup",
    "EvictionGroup",
    "GatewayGroup",
    "PriorityGroup",
    "RateLimitGroup",
    "SchedulingGroup",
    "ServerGroup",
    "Setting",
    "TenantsGroup",
    "TracingGroup",
    "declared",
    "setting",
]
