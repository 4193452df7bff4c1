"""Command line, YAML configuration and hot reload; two routers in one process share no state."""

from __future__ import annotations

import pytest

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import FAST, http, logged, metric_value, running_router, serving, stubs, wait_for
from vllm_stack.app import build_router
from vllm_stack.config import ConfigError, load_config
from vllm_stack.router_cli import build_parser, main

MSG = [{"role": "user", "content": "hi"}]


def test_production_stack_flags_are_accepted() -> None:
    args = build_parser().parse_args(
        [
            "--host", "127.0.0.1", "--port", "8080", "--service-discovery", "k8s", "--k8s-namespace", "ns",
            "--k8s-label-selector", "app=vllm,env=prod", "--k8s-port", "8001", "--routing-logic", "session",
            "--session-key", "x-user-id", "--engine-scrape-interval", "2", "--health-check-interval", "3",
            "--request-timeout", "60", "--max-body-bytes", "1024", "--log-level", "debug",
        ]
    )  # fmt: skip
    cli = {k: v for k, v in vars(args).items() if v is not None and k != "config_file"}
    cfg = load_config(cli, environ={})
    assert (cfg.service_discovery, cfg.k8s_namespace, cfg.k8s_label_selector, cfg.k8s_port) == (
        "k8s",
        "ns",
        "app=vllm,env=prod",
        8001,
    )
    assert (cfg.routing_logic, cfg.session_key, cfg.max_body_bytes, cfg.port) == (
        "session",
        "x-user-id",
        1024,
        8080,
    )


def test_kvaware_takes_the_controller_url_and_refuses_production_stacks_hosted_controller(capsys) -> None:
    args = build_parser().parse_args(
        [
            "--routing-logic",
            "kvaware",
            "--lmcache-controller-url",
            "http://ctl:9010",
            "--kv-aware-threshold",
            "500",
            "--static-backends",
            "http://e:8000",
        ]
    )
    cli = {k: v for k, v in vars(args).items() if v is not None and k != "config_file"}
    cfg = load_config(cli, environ={})
    assert (cfg.routing_logic, cfg.lmcache_controller_url, cfg.kv_aware_threshold) == (
        "kvaware",
        "http://ctl:9010",
        500,
    )
    with pytest.raises(ConfigError, match="lmcache_controller_url"):
        load_config({"routing_logic": "kvaware", "static_backends": "http://e:8000"}, environ={})
    # production-stack's router hosts the controller on this port: said plainly, not silently ignored
    with pytest.raises(SystemExit):
        main(["--routing-logic", "kvaware", "--lmcache-controller-port", "9000"])
    assert "--lmcache-controller-url" in capsys.readouterr().err


def test_yaml_then_cli_precedence_and_validation(tmp_path) -> None:
    f = tmp_path / "router.yaml"
    f.write_text(
        "static-backends: [http://a:1, http://b:2]\nstatic_models: m1,m2\nrouting-logic: leastloaded\nretries: 1\n"
    )
    cfg = load_config({"routing_logic": "p2c"}, str(f), environ={})
    assert cfg.static_backends == ("http://a:1", "http://b:2")
    assert cfg.static_models == ("m1", "m2")
    assert (cfg.routing_logic, cfg.retries) == ("p2c", 1)
    f.write_text(
        "static-backends: http://a:1\nupstream-client: aiohttp\n"
    )  # retired: a warning, not an error
    assert load_config({}, str(f), environ={}).static_backends == ("http://a:1",)
    f.write_text("static-backends: http://a:1\nbogus: 1\n")
    with pytest.raises(ConfigError, match="bogus"):
        load_config({}, str(f), environ={})
    with pytest.raises(ConfigError):
        load_config({"static_backends": "a:1"}, environ={})  # not a URL
    with pytest.raises(ConfigError):
        load_config({}, environ={})  # static discovery without backends


async def test_yaml_hot_reload_changes_backends_and_strategy_without_dropping(tmp_path, caplog) -> None:
    a, b = StubEngine("a", ["stub-model"]), StubEngine("b", ["stub-model"])
    a.behaviour.token_delay_s = 0.1
    async with stubs(a, b) as (ua, ub):
        f = tmp_path / "router.yaml"
        f.write_text(f"static-backends: [{ua}]\nrouting-logic: roundrobin\n")
        router = build_router(FAST, str(f), environ={})
        async with serving(router) as url, http(url) as h:
            await wait_for(lambda: router.registry.healthy_count == 1)
            # a long stream in flight while the file changes
            stream_cm = h.stream(
                "POST",
                "/v1/chat/completions",
                json={"model": "stub-model", "messages": MSG, "stream": True, "max_tokens": 15},
            )
            resp = await stream_cm.__aenter__()
            f.write_text(f"static-backends: [{ua}, {ub}]\nrouting-logic: session\n")
            await wait_for(
                lambda: router.config.routing_logic == "session" and router.registry.healthy_count == 2,
                within=10,
            )
            lines = [line async for line in resp.aiter_lines() if line.startswith("data:")]
            await stream_cm.__aexit__(None, None, None)
            assert len(lines) == 16 and lines[-1] == "data: [DONE]"  # the in-flight stream was not dropped
            for _ in range(6):
                r = await h.post(
                    "/v1/chat/completions",
                    json={"model": "stub-model", "messages": MSG},
                    headers={"x-session-id": "u1"},
                )
                assert r.status_code == 200
            assert len({s.headers["x-request-id"] for s in b.seen}) in (0, 6)  # session: all on one engine
            f.write_text("static-backends: [not-a-url]\n")  # a bad file is rejected; the router keeps running
            await wait_for(logged(caplog, "config reload rejected"), what="the bad file rejected")
            assert router.config.routing_logic == "session"
            assert (
                await h.post("/v1/chat/completions", json={"model": "stub-model", "messages": MSG})
            ).status_code == 200


async def test_two_routers_in_one_process_share_no_state() -> None:
    e1, e2 = StubEngine("e1", ["model-one"]), StubEngine("e2", ["model-two"])
    async with stubs(e1, e2) as (u1, u2):
        async with (
            running_router([u1]) as (url1, r1),
            running_router([u2], routing_logic="session") as (url2, r2),
        ):
            assert r1.metrics.registry is not r2.metrics.registry
            async with http(url1) as h1, http(url2) as h2:
                assert (
                    await h1.post("/v1/completions", json={"model": "model-one", "prompt": "x"})
                ).status_code == 200
                assert (
                    await h2.post("/v1/completions", json={"model": "model-one", "prompt": "x"})
                ).status_code == 404
                assert [m["id"] for m in (await h2.get("/v1/models")).json()["data"]] == ["model-two"]
                m1 = (await h1.get("/metrics")).text
                m2 = (await h2.get("/metrics")).text
            assert 'model="model-one"' in m1 and 'model="model-one",status="200"' not in m2
            assert (
                metric_value(
                    r1,
                    "vllm_stack_router_requests_total",
                    model="model-one",
                    engine=r1.registry.engines()[0].name,
                    status="200",
                )
                == 1
            )
            assert (
                metric_value(
                    r2,
                    "vllm_stack_router_requests_total",
                    model="model-one",
                    engine=r1.registry.engines()[0].name,
                    status="200",
                )
                == 0
            )
            assert r1.scheduler.profile.name == "roundrobin" and r2.scheduler.profile.name == "session"


def test_k8s_discovery_is_wired_lazily() -> None:
    """``--service-discovery k8s`` builds the Kubernetes source (constructing it contacts no API server)."""
    from vllm_stack.engines.discovery.kubernetes import KubernetesDiscovery

    router = build_router(
        {
            "service_discovery": "k8s",
            "k8s_namespace": "ns",
            "k8s_label_selector": "app=vllm",
            "k8s_port": 8001,
        },
        environ={},
    )
    assert isinstance(router.discovery, KubernetesDiscovery)


def test_config_watch_interval_is_a_positive_number_of_seconds() -> None:
    assert (
        load_config(
            {"static_backends": "http://e:8000", "config_watch_interval": "0.2"}
        ).config_watch_interval
        == 0.2
    )
    with pytest.raises(ConfigError, match="config_watch_interval"):
        load_config({"static_backends": "http://e:8000", "config_watch_interval": 0})
