"""Tenants in the chart: ``routerSpec.tenants`` rendered beside the router's configuration (the same
ConfigMap, mounted at /etc/vllm-stack/router) and named there as ``tenants_file``; a fairness header
other than llm-d's as ``tenant_header``; a declaration the router would refuse is refused by the schema;
what renders, the router loads."""

from __future__ import annotations

import pytest
import yaml

from tests.helm.chart import container, flag, one, render, render_error, router_name, values_file
from vllm_stack.config import load_config

pytestmark = pytest.mark.helm

TENANTS = [
    {"name": "team-a", "weight": 2, "requestsPerMinute": 600, "tokensPerMinute": 200000},
    {"name": "batch", "weight": 0.5},
]


def test_the_tenants_render_into_the_routers_configmap_and_the_router_loads_them(tmp_path) -> None:
    values = {"routerSpec": {"tenants": TENANTS, "tenantHeader": "x-team"}}
    objs = render([values_file(tmp_path, values)])
    data = one(objs, "ConfigMap", router_name("ConfigMap"))["data"]
    config = yaml.safe_load(data["config.yaml"])
    assert config["tenants_file"] == "/etc/vllm-stack/router/tenants.yaml"
    assert config["tenant_header"] == "x-team"
    router = container(one(objs, "Deployment", router_name("Deployment")))
    assert flag(router["args"], "--config") == "/etc/vllm-stack/router/config.yaml"
    # the router reads what the chart wrote (the paths replaced by the test's own)
    (tmp_path / "tenants.yaml").write_text(data["tenants.yaml"])
    config["tenants_file"] = str(tmp_path / "tenants.yaml")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    loaded = load_config({"static_backends": "http://e:8000"}, str(tmp_path / "config.yaml"))
    assert loaded.tenant_header == "x-team"
    spec = loaded.tenants.get("team-a")
    assert spec is not None and (spec.weight, spec.requests_per_minute, spec.tokens_per_minute) == (
        2.0,
        600,
        200000,
    )
    assert loaded.tenants.weight("batch") == 0.5


def test_no_tenants_render_nothing_of_theirs(tmp_path) -> None:
    objs = render([values_file(tmp_path, {"routerSpec": {"config": {"retries": 2}}})])
    data = one(objs, "ConfigMap", router_name("ConfigMap"))["data"]
    assert "tenants.yaml" not in data
    config = yaml.safe_load(data["config.yaml"])
    assert "tenants_file" not in config and "tenant_header" not in config
    assert "tenant_headroom_slots" not in config  # the router's default (1) is not written out
    assert "tenant_share_seconds" not in config  # nor its 5 s


@pytest.mark.parametrize(
    ("value", "setting", "given"),
    [
        ("tenantHeadroomSlots", "tenant_headroom_slots", 0),
        ("tenantHeadroomSlots", "tenant_headroom_slots", 2),
        ("tenantShareSeconds", "tenant_share_seconds", 0),
        ("tenantShareSeconds", "tenant_share_seconds", 2.5),
    ],
)
def test_the_headroom_values_render_as_the_routers_settings(
    tmp_path, value: str, setting: str, given: float
) -> None:
    objs = render([values_file(tmp_path, {"routerSpec": {value: given}})])
    config = yaml.safe_load(one(objs, "ConfigMap", router_name("ConfigMap"))["data"]["config.yaml"])
    assert config[setting] == given
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    loaded = load_config({"static_backends": "http://e:8000"}, str(tmp_path / "config.yaml"))
    assert getattr(loaded, setting) == given


@pytest.mark.parametrize("value", ["tenantHeadroomSlots", "tenantShareSeconds"])
def test_the_schema_refuses_a_negative_headroom_value(tmp_path, value: str) -> None:
    error = render_error([values_file(tmp_path, {"routerSpec": {value: -1}})])
    assert value in error


@pytest.mark.parametrize(
    "tenants",
    [
        [{"name": "other"}],
        [{"name": "a", "weight": 0}],
        [{"name": "a", "requestsPerMinute": 0}],
        [{"name": "a", "weight": 0.0001}],  # the router's bounds: weight 0.001..1e6, limits 1..1e12
        [{"name": "a", "weight": 2000000}],
        [{"name": "a", "tokensPerMinute": 10**12 + 1}],
        [{"name": "a", "rpm": 5}],
        [{"weight": 1}],
    ],
)
def test_the_schema_refuses_a_declaration_the_router_would(tmp_path, tenants: list[dict]) -> None:
    error = render_error([values_file(tmp_path, {"routerSpec": {"tenants": tenants}})])
    assert "tenants" in error
