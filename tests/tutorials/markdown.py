"""A tutorial's runnable steps: the fenced code blocks whose info string names a step.

A tutorial marks a block to be run as ```` ```bash step=NAME ```` or ```` ```python step=NAME ```` (a
markdown renderer reads only the first word, the language). Blocks without a step are for reading
(commands that need a cluster, or that the test replaces, each said in the test).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(r"^```(\w+)[ \t]+step=([\w-]+)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Step:
    name: str
    language: str  # bash or python
    code: str


def steps(path: Path) -> list[Step]:
    """The marked blocks of the markdown file at ``path``, in order."""
    return [Step(m[2], m[1], m[3]) for m in _FENCE.finditer(path.read_text())]
