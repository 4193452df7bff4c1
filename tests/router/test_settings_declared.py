"""Settings declared once (vllm_stack.settings): the command line, the reload rule, the chart's flag
table (helm/files/router-flags.yaml ``ours``), the settings table (docs/settings.md) and the chart's
values each agree with the declaration, or a test here fails naming what disagrees.

The two files are regenerated here (vllm_stack_dev.settings_docs) and compared whole: an edit by hand,
or a setting added without ``python -m vllm_stack_dev.settings_docs``, fails. The parser and
``RESTART_ONLY`` are built from the declaration; the tests pin that they stay so (a flag added by hand
to ``build_parser``, or a reload rule written beside the declaration, fails).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from vllm_stack_dev.settings_docs import FLAGS, rendered

from vllm_stack.app import RESTART_ONLY
from vllm_stack.config import DECLARED, GROUPS, RouterConfig, load_config
from vllm_stack.router_cli import HOSTED_CONTROLLER_FLAGS, build_parser
from vllm_stack.scheduling.profiles import ROUTING_LOGICS
from vllm_stack.settings import declared

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = (ROOT / "helm" / "templates" / "_router.tpl").read_text()
TEMPLATES = "".join(p.read_text() for p in sorted((ROOT / "helm" / "templates").iterdir()) if p.is_file())
SCHEMA = json.loads((ROOT / "helm" / "values.schema.json").read_text())


@pytest.mark.parametrize("path", [str(p.relative_to(ROOT)) for p in rendered(ROOT)])
def test_generated_files_are_the_declarations(path: str) -> None:
    expected = rendered(ROOT)[ROOT / path]
    assert (ROOT / path).read_text() == expected, (
        f"{path} differs from the settings declaration (router/vllm_stack/settings/): run "
        "`python -m vllm_stack_dev.settings_docs` instead of editing it"
    )


def test_flags_table_is_rendered_from_the_parser() -> None:
    """The ``ours`` table's rendering reads the parser (else the comparison above would be hollow)."""
    text = (ROOT / FLAGS).read_text()
    for item in DECLARED.values():
        for flag in item.flags:
            assert f"\n  {flag}: {'switch' if item.type == 'bool' else 'value'}\n" in text, flag


def test_every_setting_is_in_exactly_one_group_that_checks_itself() -> None:
    own = [f.name for group in GROUPS for f in dataclasses.fields(group)]
    assert len(own) == len(set(own)), "a setting declared in two groups"
    assert set(own) == {f.name for f in dataclasses.fields(RouterConfig)}, "a setting outside the groups"
    for group in GROUPS:
        assert "check" in vars(group), f"{group.__name__} has no check of its own"
        assert group.__slots__ == (), f"{group.__name__} must add no storage (RouterConfig holds the slots)"


def test_router_config_reads_are_plain_slots() -> None:
    """The request path reads ``config.x``: a slot of the one flat object, no property, no __dict__."""
    config = RouterConfig()
    assert not hasattr(config, "__dict__")
    for name in DECLARED:
        assert type(vars(RouterConfig)[name]).__name__ == "member_descriptor", name


def test_the_command_line_is_the_declaration() -> None:
    """Each flag of the parser is one declared setting's (or production-stack's hosted-controller flag,
    refused with a reason), with the declared spellings, type and choices; each declared flag parses."""
    parser = build_parser()
    by_dest = {a.dest: a for a in parser._actions if a.dest != "help"}
    hosted = {"hosted_" + f[2:].replace("-", "_") for f in HOSTED_CONTROLLER_FLAGS}
    with_flags = {name for name, item in DECLARED.items() if item.flag}
    assert set(by_dest) - hosted == with_flags
    for name in with_flags:
        item, action = DECLARED[name], by_dest[name]
        assert tuple(action.option_strings) == item.flags, name
        assert (tuple(action.choices) if action.choices else None) == item.setting.choices, name
        assert action.help == item.setting.doc, name
        if item.type == "bool":
            assert action.nargs == 0 and vars(parser.parse_args([item.flag]))[name] is True, name
        else:
            value = item.setting.choices[-1] if item.setting.choices else "7"
            parsed = vars(parser.parse_args([item.flag, value]))[name]
            assert parsed is not None and type(parsed).__name__ == {"int": "int", "float": "float"}.get(
                item.type, "str"
            ), name


def test_the_strategies_are_the_routing_logic_settings_values() -> None:
    assert DECLARED["routing_logic"].setting.choices == ROUTING_LOGICS


def test_the_reload_rule_is_the_declaration() -> None:
    declared_rule = {n: i.setting.restart for n, i in DECLARED.items() if i.setting.restart is not None}
    assert dict(RESTART_ONLY) == declared_rule


@pytest.mark.parametrize("name", [n for n, i in DECLARED.items() if i.setting.env])
def test_declared_environment_variables_are_read(name: str) -> None:
    env = DECLARED[name].setting.env
    value = {
        "batch_database_url": "postgresql://u:p@db/batches",
        "rate_limit_redis_url": "redis://:p@redis:6379/0",
    }.get(name, "sk-from-env")
    config = load_config({"static_backends": "http://e:8000"}, environ={env: value})
    assert getattr(config, name) in (value, frozenset({value})), f"{name}: {env} not read"


@pytest.mark.parametrize("name", [n for n, i in DECLARED.items() if not i.setting.in_file])
def test_settings_kept_out_of_the_file_are_refused_there(name: str, tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(f"{name}: x\n")
    with pytest.raises(Exception, match="cannot be set here"):
        load_config({"static_backends": "http://e:8000"}, str(path), environ={})


def _schema_has(path: str) -> bool:
    node = SCHEMA
    for key in path.split("."):
        node = (node.get("properties") or {}).get(key)
        if node is None:
            return False
    return True


@pytest.mark.parametrize("name", [n for n, i in DECLARED.items() if i.setting.chart])
def test_declared_chart_values_exist_and_render_the_setting(name: str) -> None:
    """The chart value a setting names is one of the chart's values, and the chart's templates render
    the setting (its flag, its name in the router's configuration file, or its environment variable)."""
    item = DECLARED[name]
    assert _schema_has(item.setting.chart), f"{name}: no {item.setting.chart} in helm/values.schema.json"
    rendered_as = [f'"{flag}"' for flag in item.flags] + [f'"{name}"']
    rendered_as += [item.setting.env] if item.setting.env else []
    assert any(word in TEMPLATES for word in rendered_as), (
        f"{name}: helm/templates/ render none of {rendered_as}"
    )


def test_every_flag_the_chart_renders_is_declared() -> None:
    flags = set(
        re.findall(
            r'"(--[a-z][a-z0-9-]*)"',
            TEMPLATE.split('define "vllm-stack.scheduler.args"')[1].split("{{- end -}}\n\n")[0],
        )
    )
    known = {flag for item in DECLARED.values() for flag in item.flags}
    assert flags and flags <= known, sorted(flags - known)


def test_the_charts_priority_defaults_are_the_declared_defaults() -> None:
    """The chart leaves out of the config file what equals the router's default: its copy of those
    defaults must be the declaration's."""
    pairs = re.findall(r'"([a-z_]+)" \(list \$[\w.]+ ([0-9.]+)\)', TEMPLATE)
    assert len(pairs) == 8  # queue_max_per_band and eviction_after among them
    for name, default in pairs:
        assert float(default) == DECLARED[name].default, name


def test_each_group_is_listed_for_the_docs() -> None:
    assert [d.name for g in GROUPS for d in declared(g)] and RouterConfig.__bases__ == GROUPS
