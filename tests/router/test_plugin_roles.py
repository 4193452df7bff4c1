"""A plugin's roles are declared by its class and checked against the framework's protocols.

Before, the configuration guessed a plugin's roles from its method names (``hasattr``): a scorer
whose method was misspelt was silently not a scorer, and a plugin with an incidental ``prepare``
method became a prepare-data hook. Now registration refuses a class whose declaration and methods
disagree, and a configuration uses each plugin in exactly the roles it declares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from vllm_stack.config import ConfigError
from vllm_stack.engines.engine import Engine
from vllm_stack.metrics import RouterMetrics
from vllm_stack.scheduling.config import build_scheduling
from vllm_stack.scheduling.framework import ROLE_PROTOCOLS, RequestContext, Role, plugin_roles
from vllm_stack.scheduling.plugins import BUILTIN_TYPES, builtin_registry
from vllm_stack.scheduling.registry import Parameters, PluginContext, PluginState


def _scheduling(*plugins: dict[str, Any]) -> dict[str, Any]:
    refs = [{"pluginRef": p.get("name", p["type"])} for p in plugins if p.get("in_profile", True)]
    entries = [{k: v for k, v in p.items() if k != "in_profile"} for p in plugins]
    return {"plugins": entries, "schedulingProfiles": [{"name": "default", "plugins": refs}]}


class Base:
    type_name = "test-base"

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> Any:  # noqa: ANN401
        return cls(name)


class FirstPicker(Base):
    type_name = "test-first-picker"
    roles = (Role.PICKER,)

    def pick(
        self, ctx: RequestContext, engines: Sequence[Engine], scores: list[float] | None
    ) -> tuple[Engine, str]:
        return engines[0], "first"


def test_every_builtin_type_declares_roles_that_match_its_methods() -> None:
    for plugin in BUILTIN_TYPES:
        roles = plugin_roles(plugin)
        assert roles, plugin
        for role in Role:
            methods = [n for n in vars(ROLE_PROTOCOLS[role]) if not n.startswith("_") and n != "name"]
            for method in methods:
                assert (getattr(plugin, method, None) is not None) == (role in roles), (plugin, method)


def test_a_class_without_roles_is_refused_at_registration() -> None:
    class NoRoles(Base):
        type_name = "test-no-roles"

        def pick(self, ctx: RequestContext, engines: Sequence[Engine], scores: Any) -> Any:  # noqa: ANN401
            return engines[0], "x"

    with pytest.raises(TypeError, match=r"NoRoles: declare its roles"):
        builtin_registry().register(NoRoles)


def test_a_method_of_an_undeclared_role_is_refused() -> None:
    """The guess this replaces: a filter with a ``score`` method was a scorer too."""

    class FilterThatScores(Base):
        type_name = "test-filter-that-scores"
        roles = (Role.FILTER,)

        def filter(self, ctx: RequestContext, engines: Sequence[Engine]) -> Sequence[Engine]:
            return engines

        def score(self, ctx: RequestContext, engines: Sequence[Engine]) -> list[float]:
            return [1.0] * len(engines)

    with pytest.raises(TypeError, match=r"has score\(\) but does not declare the role 'scorer'"):
        builtin_registry().register(FilterThatScores)


def test_a_declared_role_without_its_method_is_refused() -> None:
    class MisspeltScorer(Base):
        type_name = "test-misspelt-scorer"
        roles = (Role.SCORER,)

        def scores(self, ctx: RequestContext, engines: Sequence[Engine]) -> list[float]:
            return [1.0] * len(engines)

    with pytest.raises(TypeError, match=r"declares 'scorer' but has no score\(\) method"):
        builtin_registry().register(MisspeltScorer)


def test_a_method_taking_other_arguments_than_its_protocol_is_refused() -> None:
    class ShortPicker(Base):
        type_name = "test-short-picker"
        roles = (Role.PICKER,)

        def pick(self, engines: Sequence[Engine]) -> Any:  # noqa: ANN401 - the mistake under test
            return engines[0], "x"

    with pytest.raises(TypeError, match=r"pick\(\) must take the 3 arguments of the 'picker' protocol"):
        builtin_registry().register(ShortPicker)


def test_an_unknown_role_is_refused_with_the_known_ones() -> None:
    class Odd(Base):
        type_name = "test-odd"
        roles = ("sorter",)

    with pytest.raises(TypeError, match=r"'sorter' is not a valid Role; roles: filter, scorer"):
        builtin_registry().register(Odd)


def test_a_factory_that_makes_something_else_is_refused_when_the_configuration_is_built() -> None:
    """Registration checks the class; what its factory returns is what runs, so it is checked too."""

    class Shapeshifter(FirstPicker):
        type_name = "test-shapeshifter"

        @classmethod
        def create(cls, name: str, parameters: Parameters, context: PluginContext) -> Any:  # noqa: ANN401
            return object()

    registry = builtin_registry()
    registry.register(Shapeshifter)
    with pytest.raises(ConfigError, match=r"plugin 'test-shapeshifter': plugin object: declare its roles"):
        build_scheduling(_scheduling({"type": "test-shapeshifter"}), registry, PluginState(), RouterMetrics())


def test_plugins_are_used_in_exactly_their_declared_roles() -> None:
    """A response-complete hook listed in a profile is not a profile plugin; a declared prepare-data
    hook runs as one, in the order the plugins are listed."""

    class Preparer(Base):
        type_name = "test-preparer"
        roles = (Role.PREPARE_DATA, Role.RESPONSE_COMPLETE)

        def prepare(self, ctx: RequestContext) -> None:
            return None

        def response_complete(self, ctx: RequestContext, completion: Any) -> None:  # noqa: ANN401
            return None

    registry = builtin_registry()
    registry.register(FirstPicker)
    registry.register(Preparer)
    setup = build_scheduling(
        _scheduling({"type": "test-first-picker"}, {"type": "test-preparer", "in_profile": False}),
        registry,
        PluginState(),
        RouterMetrics(),
    )
    preparer = setup.plugins["test-preparer"]
    assert setup.hooks.prepare == (preparer.prepare,)
    assert setup.hooks.response_complete == (preparer.response_complete,)
    assert setup.description["profiles"]["default"]["picker"] == "test-first-picker"
    with pytest.raises(ConfigError, match=r"'test-preparer' is not a filter, scorer or picker"):
        build_scheduling(
            _scheduling({"type": "test-first-picker"}, {"type": "test-preparer"}),
            registry,
            PluginState(),
            RouterMetrics(),
        )
