"""How one router setting is declared: its default and, beside it, everything else that names it.

A setting is a field of a group (:mod:`vllm_stack.settings`) made with :func:`setting`; its
:class:`Setting` metadata is what the command line (``router_cli.build_parser``), the reload rule
(``app.RESTART_ONLY``), the chart's flag table (``helm/files/router-flags.yaml``) and the settings table
(``docs/settings.md``) are derived from, so none of them is written by hand. Plain dataclass fields:
the declaration costs nothing once the configuration is built (``RouterConfig`` keeps its slots).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass
from typing import Any

#: The key of a field's metadata that holds its :class:`Setting`.
KEY = "setting"


class ConfigError(ValueError):
    """Invalid router configuration (reported to the operator, never to API clients)."""


@dataclass(frozen=True, slots=True)
class Setting:
    """What a setting is beside its default. ``doc``: what it does (the flag's ``--help`` and the
    docs' table); ``flag``: the command-line flag (``""``: none; default ``--`` and the name with
    dashes), ``aliases`` other spellings of it (production-stack's); ``negatable``: a boolean flag
    with a ``--no-`` form (otherwise a boolean flag only turns it on); ``choices`` the values the flag
    takes; ``restart``: why a running router keeps the value it started with (``None``: a reload
    applies it); ``chart``: the Helm value the chart renders it from; ``env``: an environment variable
    it is read from; ``in_file``: whether the YAML file may set it; ``parse``: converts a YAML/flag
    value where the field's type alone does not say how."""

    doc: str
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    negatable: bool = False
    choices: tuple[str, ...] | None = None
    restart: str | None = None
    chart: str | None = None
    env: str | None = None
    in_file: bool = True
    parse: Callable[[Any], Any] | None = None


def setting(
    default: Any = MISSING,  # noqa: ANN401 - any setting's type
    *,
    doc: str,
    factory: Callable[[], Any] | None = None,
    compare: bool = True,
    repr: bool = True,  # noqa: A002 - dataclasses.field's own name
    **meta: Any,  # noqa: ANN401 - Setting's fields
) -> Any:  # noqa: ANN401 - a dataclass field stands for its value
    """A group's field with its :class:`Setting`: ``host: str = setting("0.0.0.0", doc=...)``."""
    metadata = {KEY: Setting(doc=doc, **meta)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, compare=compare, repr=repr, metadata=metadata)
    return dataclasses.field(default=default, compare=compare, repr=repr, metadata=metadata)


@dataclass(frozen=True, slots=True)
class Declared:
    """One declared setting as the derived artefacts read it."""

    name: str
    type: str  # the annotation as written (``from __future__ import annotations``)
    default: Any
    setting: Setting

    @property
    def flag(self) -> str | None:
        """The command-line flag, or None when the setting has none."""
        given = self.setting.flag
        if given == "":
            return None
        return given or "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> tuple[str, ...]:
        """Every spelling the command line takes (the flag, its aliases and its ``--no-`` form)."""
        if self.flag is None:
            return ()
        negative = ("--no-" + self.flag[2:],) if self.setting.negatable else ()
        return (self.flag, *self.setting.aliases, *negative)


def declared(group: type) -> Iterator[Declared]:
    """The settings of one group (or of the whole ``RouterConfig``), in declaration order."""
    for f in dataclasses.fields(group):
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = None
        yield Declared(f.name, str(f.type), default, f.metadata[KEY])
