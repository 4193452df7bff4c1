"""The rate limits' shared store in the chart (routerSpec.rateLimitStore): the Redis URL reaches the router
as VLLM_STACK_RATE_LIMIT_REDIS_URL from the user's Secret, never as a flag or a literal; without it the
router has no store (each replica its own buckets); a store without a Secret name is refused."""

from __future__ import annotations

import pytest

from tests.helm.chart import container, env_of, find, one, render, render_error, router_name, values_file

pytestmark = pytest.mark.helm

ENV = "VLLM_STACK_RATE_LIMIT_REDIS_URL"


def _router(objs: list[dict]) -> dict:
    return container(one(objs, "Deployment", router_name("Deployment")))


def test_the_store_url_comes_from_its_secret(tmp_path) -> None:
    values = {
        "routerSpec": {"replicaCount": 3, "rateLimitStore": {"secretName": "limits-redis", "secretKey": "u"}}
    }
    objs = render([values_file(tmp_path, values)])
    router = _router(objs)
    assert env_of(router)[ENV] == {
        "name": ENV,
        "valueFrom": {"secretKeyRef": {"name": "limits-redis", "key": "u"}},
    }
    assert not [a for a in router["args"] if "redis" in a.lower()]
    assert not [s for s in find(objs, "Secret") if "limits-redis" in str(s.get("metadata"))]


def test_the_secret_key_defaults_to_url(tmp_path) -> None:
    objs = render([values_file(tmp_path, {"routerSpec": {"rateLimitStore": {"secretName": "r"}}})])
    assert env_of(_router(objs))[ENV]["valueFrom"]["secretKeyRef"] == {"name": "r", "key": "url"}


def test_no_store_no_variable(tmp_path) -> None:
    objs = render([values_file(tmp_path, {})])
    assert ENV not in env_of(_router(objs))


def test_a_store_without_a_secret_name_is_refused(tmp_path) -> None:
    error = render_error([values_file(tmp_path, {"routerSpec": {"rateLimitStore": {"secretKey": "u"}}})])
    assert "secretName" in error
