"""Who sent a request (vllm_stack.tenants.identity): the client key's name, else the fairness header,
else the shared tenant; the keys file's ``NAME: KEY`` lines and older files of bare keys; the tenants
declaration and its bounded metric labels. Through a running router, the resolved tenant is on the
request's context, where the queue, the rate limiter and eviction read it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import http, running_router, stubs
from vllm_stack.app import Router
from vllm_stack.config import ConfigError, load_config
from vllm_stack.scheduling.framework import Completion, RequestContext
from vllm_stack.tenants.declaration import TenantSpec, TenantTable, parse_tenants
from vllm_stack.tenants.identity import (
    DEFAULT_TENANT,
    TenantIdentity,
    split_key_line,
    unnamed_key_tenant,
)

BASE = "stub-model"
BODY = {"model": BASE, "prompt": "hi", "max_tokens": 1}


# ---- the rules, on their own ---------------------------------------------------------------------------
def test_a_keys_file_line_names_its_key_only_in_the_name_colon_space_form() -> None:
    assert split_key_line("team-a: sk-123") == ("sk-123", "team-a")
    assert split_key_line("team.b:\tsk-456") == ("sk-456", "team.b")
    # every line of an older file is a key as it stands: bearer tokens hold no whitespace
    assert split_key_line("sk-123") == ("sk-123", None)
    assert split_key_line("sk:123") == ("sk:123", None)
    assert split_key_line("bad name: sk-1") == ("bad name: sk-1", None)


def test_an_unnamed_key_is_its_own_stable_tenant_that_does_not_show_the_key() -> None:
    name = unnamed_key_tenant(b"sk-secret-key")
    assert name == unnamed_key_tenant(b"sk-secret-key") != unnamed_key_tenant(b"sk-other-key")
    assert name.startswith("key-") and len(name) == 16 and "secret" not in name
    identity = TenantIdentity({"sk-named": "team-a"}, keys_on=True)
    assert identity.of_key(b"sk-named") == "team-a"
    assert identity.of_key(b"sk-secret-key") == name
    assert identity.of_key(None) == DEFAULT_TENANT
    assert "sk-named" not in repr(identity)
    assert not identity.headers  # with keys on, no header is read


def test_the_header_names_the_tenant_without_keys_trimmed_and_bounded() -> None:
    identity = TenantIdentity({}, keys_on=False)
    # llm-d's header decides over its deprecated alias (rank 0 before 1)
    assert identity.headers == {b"x-llm-d-inference-fairness-id": 0, b"x-gateway-inference-fairness-id": 1}
    # another header configured is the only one read (a gateway that writes it may pass llm-d's through)
    assert TenantIdentity({}, keys_on=False, header="X-Team").headers == {b"x-team": 0}
    assert identity.of_header(b"  team-b ") == "team-b"
    assert identity.of_header(b"") == DEFAULT_TENANT
    assert identity.of_header(b"x" * 500) == "x" * 64


def test_a_header_value_is_read_as_utf8_and_cut_at_64_characters_not_bytes() -> None:
    identity = TenantIdentity({}, keys_on=False)
    assert identity.of_header("équipe-é".encode()) == "équipe-é"  # was: latin-1, "Ã©quipe-Ã©"
    assert identity.of_header("é".encode() * 100) == "é" * 64  # was: 32 and a split character
    assert identity.of_header(b"team-\xff") == "team-\ufffd"  # not UTF-8: the replacement character


def test_a_declaration_reads_both_spellings_and_bounds_the_labels() -> None:
    table = parse_tenants(
        {
            "tenants": [
                {"name": "team-a", "weight": 2, "requests_per_minute": 60},
                {"name": "team-b", "tokensPerMinute": 1000, "requestsPerMinute": 5},
            ]
        },
        "t.yaml",
    )
    assert table.get("team-a") == TenantSpec("team-a", 2.0, 60, None)
    assert table.get("team-b") == TenantSpec("team-b", 1.0, 5, 1000)
    assert table.weight("team-a") == 2.0 and table.weight("nobody") == 1.0
    assert [table.label(n) for n in ("team-a", "default", "made-up", "key-0123456789ab")] == [
        "team-a",
        "default",
        "other",
        "other",
    ]
    assert parse_tenants(None, "t.yaml") == TenantTable()


@pytest.mark.parametrize(
    ("tenants", "error"),
    [
        ([{"name": "other"}], "metric label of undeclared"),
        ([{"name": "a"}, {"name": "a"}], "declared twice"),
        ([{"name": "a", "weight": 0}], "'weight' must be a positive"),
        ([{"name": "a", "weight": True}], "'weight' must be a positive"),
        ([{"name": "a", "requests_per_minute": 1.5}], "'requests_per_minute' must be a positive integer"),
        # huge numbers: the declaration's own error (was: OverflowError, a traceback at start)
        ([{"name": "a", "weight": 10**400}], "'weight' must be a positive"),
        ([{"name": "a", "weight": float("inf")}], "'weight' must be a positive"),
        ([{"name": "a", "weight": float("nan")}], "'weight' must be a positive"),
        ([{"name": "a", "weight": 1e-320}], "'weight' must be a positive"),
        ([{"name": "a", "requests_per_minute": 10**400}], "'requests_per_minute' must be a positive integer"),
        ([{"name": "a", "tokens_per_minute": 10**12 + 1}], "'tokens_per_minute' must be a positive integer"),
        ([{"name": "a", "wieght": 2}], "unknown field"),
        ([{"name": "has space"}], "'name' must be"),
        ({"tenants": {"a": 1}}, "expected a list"),
    ],
)
def test_a_bad_declaration_fails_the_configuration_with_its_reason(
    tmp_path: Path, tenants: object, error: str
) -> None:
    import yaml

    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(tenants if isinstance(tenants, dict) else {"tenants": tenants}))
    with pytest.raises(ConfigError, match=error):
        load_config({"tenants_file": str(path), "static_backends": "http://127.0.0.1:9"}, environ={})


def test_keys_files_with_and_without_names_load_the_same_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# clients\nteam-a: sk-aaa\nsk-bare\n\n")
    config = load_config(
        {"api_keys_file": str(keys), "static_backends": "http://127.0.0.1:9"},
        environ={"VLLM_STACK_API_KEYS": "team-b: sk-bbb, sk-env"},
    )
    assert config.api_keys == {"sk-aaa", "sk-bare", "sk-bbb", "sk-env"}
    assert config.api_key_names == {"sk-aaa": "team-a", "sk-bbb": "team-b"}
    assert "sk-aaa" not in repr(config)


# ---- through a running router ---------------------------------------------------------------------------
@contextmanager
def tenants_seen(router: Router) -> Iterator[list[str]]:
    """The tenant of every request the router ends, as its context carries it to the director's
    stages (a response-complete hook, as any plugin's)."""
    seen: list[str] = []

    def spy(ctx: RequestContext, _completion: Completion) -> None:
        seen.append(ctx.tenant)

    director = router.director
    hooks = director.hooks
    director.hooks = dataclasses.replace(hooks, response_complete=(*hooks.response_complete, spy))
    try:
        yield seen
    finally:
        director.hooks = hooks


async def test_without_keys_the_fairness_header_or_its_alias_names_the_tenant() -> None:
    async with stubs(StubEngine("a", [BASE])) as urls, running_router(urls) as (url, router), http(url) as h:
        with tenants_seen(router) as seen:
            for headers in (
                {"x-llm-d-inference-fairness-id": "team-a"},
                {"x-gateway-inference-fairness-id": "team-b"},
                {},
            ):
                r = await h.post("/v1/completions", json=BODY, headers=headers)
                assert r.status_code == 200, r.text
        assert seen == ["team-a", "team-b", DEFAULT_TENANT]


async def test_a_client_cannot_override_the_deciding_header_by_sending_another_after_it() -> None:
    """A gateway wrote the tenant's header; the client appended another (the alias, or the same header
    again). The configured header decides whatever the order, and its first value (was: the last header
    of either name won, so a client could spend any tenant's limits and share)."""
    primary, alias = "x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id"
    async with stubs(StubEngine("a", [BASE])) as urls, running_router(urls) as (url, router), http(url) as h:
        with tenants_seen(router) as seen:
            for headers in (
                [(primary, "team-a"), (alias, "victim")],
                [(alias, "victim"), (primary, "team-a")],
                [(primary, "team-a"), (primary, "victim")],
                [(alias, "team-b"), (alias, "victim")],
            ):
                r = await h.post("/v1/completions", json=BODY, headers=headers)
                assert r.status_code == 200, r.text
        assert seen == ["team-a", "team-a", "team-a", "team-b"]
    async with (
        stubs(StubEngine("a", [BASE])) as urls,
        running_router(urls, tenant_header="x-team") as (url, router),
        http(url) as h,
    ):
        with tenants_seen(router) as seen:
            for headers in ([("x-team", "team-a"), (primary, "victim")], [(primary, "victim"), (alias, "v")]):
                r = await h.post("/v1/completions", json=BODY, headers=headers)
                assert r.status_code == 200, r.text
        assert seen == ["team-a", DEFAULT_TENANT]  # with x-team configured, llm-d's header names nobody


async def test_with_keys_the_key_names_the_tenant_and_the_header_is_ignored(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("team-a: sk-aaa\nsk-bare\n")
    async with (
        stubs(StubEngine("a", [BASE])) as urls,
        running_router(urls, api_keys_file=str(keys)) as (url, router),
        http(url) as h,
    ):
        with tenants_seen(router) as seen:
            for key in ("sk-aaa", "sk-bare"):
                r = await h.post(
                    "/v1/completions",
                    json=BODY,
                    headers={"authorization": f"Bearer {key}", "x-llm-d-inference-fairness-id": "team-z"},
                )
                assert r.status_code == 200, r.text
            # the line's name is not part of the key
            r = await h.post("/v1/completions", json=BODY, headers={"authorization": "Bearer team-a: sk-aaa"})
            assert r.status_code == 401
        assert seen == ["team-a", unnamed_key_tenant(b"sk-bare")]
