"""Hot reload: every router setting either takes effect on the running router or is named in a
warning that it needs a restart; none is ignored silently.

The settings come from the config module itself (``dataclasses.fields(RouterConfig)``), so one added
later is held to this as well: it needs a probe here (where the running router shows the new value)
or an entry in ``vllm_stack.app.RESTART_ONLY`` (the warning). A router is started for each setting
over one backend where nothing listens (the engine stays unhealthy, which no probe minds), reloaded
with that one setting changed, and looked at.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import logged, running_router, stubs, wait_for
from vllm_stack.app import RESTART_ONLY, Router, build_router
from vllm_stack.config import ConfigError, RouterConfig, load_config
from vllm_stack.tenants.declaration import TenantSpec, TenantTable

BACKEND = "http://127.0.0.1:9"  # the discard port: nothing listens on loopback
KVAWARE = {"routing_logic": "kvaware", "lmcache_controller_url": "http://127.0.0.1:9"}
DISAGG = {"disaggregation": True}
PRIORITY = {"routing_logic": "priority"}
_UNSET = object()


@dataclass(frozen=True)
class Probe:
    """Where a running router shows one setting: ``observe`` returns ``expect`` (default: ``value``)
    after the reload and something else before it. ``value`` may be a function of the test's
    ``tmp_path`` and ``request`` (a keys file, a fixture); ``base``: settings the router starts with
    so that this one matters (kvaware's, disaggregation's)."""

    value: Any
    observe: Callable[[Router], Any]
    expect: Any = _UNSET
    base: Mapping[str, Any] = field(default_factory=dict)


def picker(router: Router, profile: str = "prefixaware") -> Any:  # noqa: ANN401 - a plugin
    return router.scheduler.profiles[profile].picker


def plugin(router: Router, name: str) -> Any:  # noqa: ANN401 - a plugin
    profiles = router.scheduler.profiles.values()
    return next(f for p in profiles for f in p.filters if getattr(f, "name", None) == name)


def engines(router: Router) -> list[Any]:
    return router.registry.engines()


def keys_file(tmp_path: Path, _request: pytest.FixtureRequest) -> str:
    path = tmp_path / "keys.txt"
    path.write_text("sk-reloaded\n")
    return str(path)


def tenants_file(tmp_path: Path, _request: pytest.FixtureRequest) -> str:
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - {name: team-a, weight: 2}\n")
    return str(path)


def disagg(attribute: str, value: Any) -> Probe:  # noqa: ANN401 - the setting's value
    return Probe(value, lambda r: getattr(r.director.settings.disagg, attribute), base=DISAGG)


LONG_PROMPT = b'{"model": "m", "prompt": "' + b"a" * 2000 + b'"}'

#: Settings that take effect on reload, and where the running router shows each.
PROBES: dict[str, Probe] = {
    "static_backends": Probe(
        ("http://127.0.0.1:10",), lambda r: tuple(e.url for e in engines(r)), ("http://127.0.0.1:10",)
    ),
    "static_models": Probe(("m",), lambda r: [e.static_models for e in engines(r)], [("m",)]),
    "static_roles": Probe(("decode",), lambda r: [e.role for e in engines(r)], ["decode"]),
    "routing_logic": Probe("session", lambda r: "session" in r.scheduler.profiles, True),
    "scheduling": Probe(
        {
            "plugins": [{"type": "round-robin-picker"}],
            "schedulingProfiles": [{"name": "custom", "plugins": [{"pluginRef": "round-robin-picker"}]}],
        },
        lambda r: sorted(r.scheduler.profiles),
        ["custom"],
    ),
    "session_key": Probe("x-user", lambda r: r.session_header, b"x-user"),
    "session_balance_epsilon": Probe(0.5, lambda r: picker(r).epsilon),
    "prefix_chars": Probe(512, lambda r: len(r.parser.parse(LONG_PROMPT).prefix or b"")),
    "tokenizers": Probe(
        lambda _tmp, request: {"stub-model": str(request.getfixturevalue("tiny_model_dir"))},
        lambda r: sorted(picker(r).tokenizers),
        ["stub-model"],
    ),
    "kv_events": Probe("on", lambda r: len(r.kv_feed.consumers), 1),
    "lmcache_controller_url": Probe(
        "http://127.0.0.1:10", lambda r: picker(r, "kvaware").controller.url, base=KVAWARE
    ),
    "prefix_min_match_length": Probe(2048, lambda r: picker(r).min_match_tokens, 512.0),
    "priority_threshold": Probe(4, lambda r: r.scheduler.handler.threshold, base=PRIORITY),
    "priority_default": Probe(6, lambda r: r.scheduler.handler.default, base=PRIORITY),
    "kv_aware_threshold": Probe(3000, lambda r: picker(r, "kvaware").threshold, base=KVAWARE),
    "lmcache_lookup_timeout": Probe(0.5, lambda r: picker(r, "kvaware").controller.timeout, base=KVAWARE),
    "debug_headers": Probe(True, lambda r: r.director.settings.debug_headers),
    "wake_sleeping_engines": Probe(False, lambda r: r.director.settings.wake_sleeping),
    "stream_continuation": Probe(False, lambda r: r.director.settings.stream_continuation),
    "lora_adapters": Probe(
        ({"name": "ad", "source": "/models/ad", "base_model": "stub-model"},),
        lambda r: r.catalog is not None and r.catalog.get("ad") is not None,
        True,
    ),
    "weighted_models": Probe(
        {"split": [{"model": "stub-model", "weight": 1}]},
        lambda r: r.catalog is not None and r.catalog.target("split", None),
        "stub-model",
    ),
    "lora_load_timeout": Probe(60.0, lambda r: r.adapters.load_timeout),
    "models": Probe(("m1",), lambda r: sorted(r.priority.models), ["m1"]),
    "priority_scheduling": Probe(False, lambda r: "critical" in r.scheduler.profiles),
    "priority_header": Probe("x-prio", lambda r: r.priority.header, b"x-prio"),
    "priority_api_keys_file": Probe(keys_file, lambda r: r.priority.raisers.enabled, True),
    "priority_api_keys": Probe(frozenset({"sk-p"}), lambda r: r.priority.raisers.enabled, True),
    "saturation_max_waiting": Probe(7.0, lambda r: plugin(r, "saturation-filter").limits.max_waiting),
    "saturation_max_kv_cache_usage": Probe(
        0.9, lambda r: plugin(r, "saturation-filter").limits.max_kv_cache_usage
    ),
    "critical_max_waiting": Probe(60.0, lambda r: plugin(r, "low-queue-filter").max_waiting),
    "critical_reserve_slots": Probe(1, lambda r: plugin(r, "saturation-filter").limits.reserve_slots),
    "tenant_headroom_slots": Probe(
        0,
        lambda r: (plugin(r, "saturation-filter").limits.headroom_slots, r.director.settings.tenant_headroom),
        (0, False),
    ),
    "tenant_share_seconds": Probe(2.0, lambda r: r.director.shares.share_seconds),
    "disaggregation": Probe(True, lambda r: r.director.settings.disagg is not None),
    "disagg_min_uncached_tokens": Probe(
        512, lambda r: r.scheduler.disaggregation.decider.min_uncached_tokens, base=DISAGG
    ),
    "disagg_receiver_init_port": disagg("receiver_init_port", 7301),
    "disagg_receiver_alloc_port": disagg("receiver_alloc_port", 7401),
    "disagg_notify_timeout": disagg("notify_timeout", 5.0),
    "queue_max_per_model": Probe(5, lambda r: r.queue.max_per_model),
    "queue_max_per_band": Probe(3, lambda r: r.queue.max_per_band),
    "queue_timeout": Probe(90.0, lambda r: r.director.settings.queue_timeout),
    "eviction_enabled": Probe(True, lambda r: r.director.settings.eviction_after, 2.0),
    "eviction_after": Probe(
        5.0, lambda r: r.director.settings.eviction_after, base={"eviction_enabled": True}
    ),
    "engine_scrape_interval": Probe(
        2.5, lambda r: (r.scraper.interval, [e.stale_after for e in engines(r)]), (2.5, [7.5])
    ),
    "health_check_interval": Probe(7.0, lambda r: r.registry.check_interval),
    "health_failure_threshold": Probe(4, lambda r: r.registry.failure_threshold),
    "health_success_threshold": Probe(3, lambda r: r.registry.success_threshold),
    "circuit_failure_threshold": Probe(6, lambda r: [e.breaker.failure_threshold for e in engines(r)], [6]),
    "circuit_open_seconds": Probe(20.0, lambda r: [e.breaker.open_seconds for e in engines(r)], [20.0]),
    "request_timeout": Probe(300.0, lambda r: r.request_timeout()),
    "connect_timeout": Probe(2.5, lambda r: r.pools.get(BACKEND).connect_timeout),
    "max_body_bytes": Probe(1000, lambda r: r.body_limit()),
    "max_buffered_body_bytes": Probe(64 << 20, lambda r: r.buffer_limit()),
    "max_body_share_per_key": Probe(0.5, lambda r: r.body_share_limit(), 128 << 20),
    "request_head_timeout": Probe(10.0, lambda r: r.head_timeout()),
    "request_body_timeout": Probe(10.0, lambda r: r.body_timeout()),
    "max_connections": Probe(10, lambda r: r.connection_limit()),
    "retries": Probe(0, lambda r: r.director.settings.retries),
    "api_keys_file": Probe(keys_file, lambda r: r.auth.enabled, True),
    "api_keys": Probe(frozenset({"sk-a"}), lambda r: r.auth.enabled, True),
    "admin_api_keys_file": Probe(keys_file, lambda r: r.admin_auth.enabled, True),
    "admin_api_keys": Probe(frozenset({"sk-admin"}), lambda r: r.admin_auth.enabled, True),
    "api_key_names": Probe({"sk-a": "team-a"}, lambda r: r.identity.of_key(b"sk-a"), "team-a"),
    "tenant_header": Probe("x-team", lambda r: b"x-team" in r.identity.headers, True),
    "tenants_file": Probe(tenants_file, lambda r: r.tenants.weight("team-a"), 2.0),
    "tenants": Probe(
        TenantTable([TenantSpec("team-a", weight=2.0)]),
        lambda r: (r.tenants.weight("team-a"), r.queue.tenants.weight("team-a")),
        (2.0, 2.0),
    ),
    "json_parser": Probe("orjson", lambda r: r.parser.name),
    "log_level": Probe("debug", lambda _r: logging.getLogger().level, logging.DEBUG),
    "access_log": Probe(True, lambda r: r.director.settings.access_log),
}


def other_value(name: str, current: Any) -> Any:  # noqa: ANN401 - any setting's value
    """Another value of a setting without a probe (one that should warn): only reload sees it."""
    if isinstance(current, bool):
        return not current
    if isinstance(current, int | float):
        return current + 1
    if isinstance(current, str) or current is None:
        return f"{current or ''}changed"
    if isinstance(current, tuple):
        return (*current, "changed")
    if isinstance(current, frozenset):
        return current | {"changed"}
    pytest.fail(f"{name}: no probe in {__name__}.PROBES and no generic other value for {current!r}")


def test_restart_only_settings_exist_and_have_no_probe() -> None:
    names = {f.name for f in fields(RouterConfig)}
    assert set(RESTART_ONLY) <= names, set(RESTART_ONLY) - names
    assert not set(RESTART_ONLY) & set(PROBES)
    assert set(PROBES) <= names, set(PROBES) - names


@pytest.mark.parametrize("name", [f.name for f in fields(RouterConfig)])
async def test_every_setting_is_applied_on_reload_or_warned(
    name: str, tmp_path: Path, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    """Fails for a setting that a reload neither applies (its probe sees the new value) nor names in
    a restart warning. Breaks checked: removing ``self.registry.configure(...)`` from ``reload``
    (thresholds, intervals), ``self.pools.set_connect_timeout``, the log level line, or an entry of
    ``RESTART_ONLY`` (e.g. ``shutdown_grace``) each fail their settings here."""
    probe = PROBES.get(name)
    cli: dict[str, Any] = {"static_backends": BACKEND, **(probe.base if probe else {})}
    base = load_config(cli, environ={})
    if probe is None:
        value = other_value(name, getattr(base, name))
    else:
        value = probe.value(tmp_path, request) if callable(probe.value) else probe.value
    if name.endswith("_keys_file") or name == "tenants_file":  # files read as a configuration is loaded
        changed = load_config({**cli, name: value}, environ={})
    else:
        changed = replace(base, **{name: value})
    root_level = logging.getLogger().level
    router = Router(base, environ={})
    await router.start()
    try:
        await wait_for(lambda: bool(router.registry.engines()), what="discovery's first snapshot")
        before = probe.observe(router) if probe is not None else None
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vllm_stack.app"):
            router.reload(changed)
        warned = [r for r in caplog.records if r.getMessage().startswith(f"config: {name} changed")]
        if probe is None:
            assert warned, (
                f"{name} changed on reload: not applied (no probe in {__name__}.PROBES) and not warned "
                "(not in vllm_stack.app.RESTART_ONLY)"
            )
            assert "restart" in warned[0].getMessage()
            return
        assert not warned, f"{name} is applied, yet a reload warns it needs a restart"
        expect = value if probe.expect is _UNSET else probe.expect
        assert before != expect, f"{name}: the probe shows {expect!r} before the reload already"
        # At once, but for discovery's new snapshot, which reaches the registry a loop turn later.
        await wait_for(lambda: probe.observe(router) == expect, within=5.0, what=f"{name} applied on reload")
    finally:
        await router.stop()
        logging.getLogger().setLevel(root_level)


async def test_new_intervals_take_effect_in_the_running_loops() -> None:
    """A reload that shortens the health-check and scrape intervals from 1000 s speeds up the running
    loops within about a second: neither waits out the old interval. The engine is healthy, so only
    a full health-check round probes it again, and a scrape round reads its metrics again.

    Kills: in ``engines/registry.py`` ``run_health_checks``, reading ``self.check_interval`` once
    before the loop; in ``telemetry/scraper.py`` ``run``, sleeping ``self.interval`` in one wait.
    """
    engine = StubEngine("e")
    slow = {"health_check_interval": 1000.0, "engine_scrape_interval": 1000.0}
    async with stubs(engine) as urls, running_router(urls, **slow) as (_, router):
        (known,) = router.registry.engines()
        await wait_for(lambda: known.telemetry is not None, what="the first scrape")
        checked, scraped = known.last_check, known.telemetry.scraped_at
        router.reload(replace(router.config, health_check_interval=0.1, engine_scrape_interval=0.1))
        await wait_for(
            lambda: known.last_check > checked, within=3.0, what="a health check at the new interval"
        )
        await wait_for(
            lambda: known.telemetry is not None and known.telemetry.scraped_at > scraped,
            within=3.0,
            what="a scrape at the new interval",
        )


def test_an_unknown_log_level_rejects_the_reload_and_changes_nothing() -> None:
    """The level is checked before anything is applied, as the scheduling is (the watcher keeps the
    running configuration and logs the refusal)."""
    router = Router(load_config({"static_backends": BACKEND}, environ={}), environ={})
    changed = replace(router.config, log_level="loud", routing_logic="session")
    with pytest.raises(ConfigError, match="log_level"):
        router.reload(changed)
    assert router.config.routing_logic == "prefixaware" and "session" not in router.scheduler.profiles


async def test_a_bad_tenants_declaration_or_header_keeps_the_watcher_and_the_running_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reloads that fail (a weight or a limit too large for a float, a tenant_header that is no header
    name, any other error of a reload) leave the running configuration whole and the watcher alive: a
    later good edit still applies. Was: OverflowError, and UnicodeEncodeError after the scheduling was
    swapped, ended the watcher silently (it caught ConfigError only)."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants: [{name: a, weight: 2}]\n")
    config = tmp_path / "router.yaml"
    head = f"static-backends: [{BACKEND}]\ntenants-file: {tenants}\n"
    config.write_text(head + "tenant-header: x-team\n")
    router = build_router({}, str(config), environ={})
    scheduling = router.scheduler
    watcher = asyncio.ensure_future(router._watch_config(str(config), 0.02))
    await asyncio.sleep(0)  # one turn of the loop (not a wait): the watcher reads the file's first mtime
    stamp = [config.stat().st_mtime_ns]

    def edit(text: str) -> None:  # a new mtime each time, however coarse the file system's clock
        config.write_text(text)
        stamp[0] += 10**9
        os.utime(config, ns=(stamp[0], stamp[0]))

    try:
        with caplog.at_level(logging.ERROR):
            for bad_tenants in (
                "tenants: [{name: a, weight: 1%s}]\n" % ("0" * 400),
                "tenants: [{name: a, requests_per_minute: 1%s}]\n" % ("0" * 400),
            ):
                caplog.clear()
                tenants.write_text(bad_tenants)
                edit(head + "tenant-header: x-team\nrouting-logic: session\n")
                await wait_for(logged(caplog, "config reload rejected"), what="the huge number's rejection")
            caplog.clear()
            tenants.write_text("tenants: [{name: a, weight: 3}]\n")
            edit(head + "tenant-header: x-tëam\nrouting-logic: session\n")
            await wait_for(
                logged(caplog, "tenant_header must be a header name"), what="the header's rejection"
            )
            assert router.config.tenants.weight("a") == 2 and router.config.tenant_header == "x-team"
            assert router.scheduler is scheduling and b"x-team" in router.identity.headers
            real_reload = router.reload
            monkeypatch.setattr(router, "reload", lambda _config: (_ for _ in ()).throw(OverflowError("bug")))
            caplog.clear()
            edit(head + "tenant-header: x-team\nrouting-logic: session\n")
            await wait_for(logged(caplog, "config reload failed"), what="the failing reload's log")
            monkeypatch.setattr(router, "reload", real_reload)
            edit(head + "tenant-header: x-other\nrouting-logic: session\n")
            await wait_for(
                lambda: router.config.tenant_header == "x-other", what="the good edit after the failures"
            )
        assert router.config.tenants.weight("a") == 3 and b"x-other" in router.identity.headers
        assert not watcher.done()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
