"""Writes what is derived from the router's settings declaration (vllm_stack.settings) into files.

Two files hold it: ``docs/settings.md`` (the settings table: every setting, its flag, default, reload
rule, chart value and environment variable, by group) and the ``ours`` table of
``helm/files/router-flags.yaml`` (every flag of the router's parser, which the chart passes through from
``routerSpec.extraArgs``). ``python -m vllm_stack_dev.settings_docs`` rewrites both after a setting
changed; ``--check`` only says whether they are current. tests/router/test_settings_declared.py
compares them with what this module renders, so a stale file fails the tests.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from vllm_stack.config import GROUPS, RouterConfig
from vllm_stack.router_cli import build_parser
from vllm_stack.settings import Declared, declared
from vllm_stack_dev.paths import repo_root

DOCS = Path("docs") / "settings.md"
FLAGS = Path("helm") / "files" / "router-flags.yaml"
OURS_START = "ours:\n"
OURS_END = "productionStack:\n"

HEADER = """\
# Router settings

Every setting of `vllm-stack router`, by group. Generated from the declaration in
`router/vllm_stack/settings/` by `python -m vllm_stack_dev.settings_docs` (tests/router/test_settings_declared.py
fails when this file differs): change a setting there, never here.

A setting is given as a flag, or in the `--config` YAML file under its name (`-` or `_` alike; lists as
YAML lists or comma-separated); a flag given on the command line wins over the file, the file over the
default. **Reload**: a change to the file is applied to the running router (*applied*), or logged as
needing a restart, with the reason (*restart*). **Chart**: the Helm value the chart renders it from
(`helm/values.yaml`); a flag of this router passes through `routerSpec.extraArgs` too (not `--batch-*`,
which are `routerSpec.batch`'s).
"""


def _default(value: Any) -> str:  # noqa: ANN401 - any setting's default
    if value is None or value in ((), frozenset(), ""):
        return "—"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _row(item: Declared) -> str:
    decl = item.setting
    name = f"`{item.name}`" if decl.in_file else f"`{item.name}` (not in the file)"
    flags = " / ".join(f"`{flag}`" for flag in item.flags) or "—"
    reload = f"restart: {decl.restart}" if decl.restart else "applied"
    source = [f"`{decl.chart}`"] if decl.chart else []
    source += [f"env `{decl.env}`"] if decl.env else []
    choices = f"; one of {', '.join(decl.choices)}" if decl.choices else ""
    cells = (name, flags, _default(item.default), reload, ", ".join(source) or "—", decl.doc + choices)
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def render_docs() -> str:
    """docs/settings.md as the declaration says."""
    parts = [HEADER]
    for group in GROUPS:
        title = group.__name__.removesuffix("Group")
        intro = " ".join((sys.modules[group.__module__].__doc__ or "").split())
        parts.append(f"\n## {title}\n\n{intro}\n\n")
        parts.append(
            "| setting | flag | default | reload | chart / env | what |\n|---|---|---|---|---|---|\n"
        )
        parts.extend(_row(item) + "\n" for item in declared(group))
    return "".join(parts)


def render_flags(current: str) -> str:
    """``current`` (router-flags.yaml) with its ``ours`` table replaced by the parser's flags: each
    ``value`` when it takes one, ``switch`` when not."""
    flags: dict[str, str] = {}
    for action in build_parser()._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                flags[option] = "value" if action.nargs != 0 else "switch"
    start = current.index(OURS_START) + len(OURS_START)
    end = current.index(OURS_END, start)
    table = "".join(f"  {flag}: {kind}\n" for flag, kind in sorted(flags.items()))
    return current[:start] + table + current[end:]


def rendered(root: Path) -> dict[Path, str]:
    """Each derived file and what it should hold."""
    return {
        root / DOCS: render_docs(),
        root / FLAGS: render_flags((root / FLAGS).read_text()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_stack_dev.settings_docs", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only say which files are stale (exit 1)")
    args = parser.parse_args(argv)
    assert RouterConfig.__bases__ == GROUPS
    stale = []
    for path, text in rendered(repo_root()).items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text)
    for path in stale:
        print(f"{path}: {'stale' if args.check else 'written'}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
