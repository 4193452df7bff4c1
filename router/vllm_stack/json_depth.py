"""How deeply a JSON document may nest: one limit for every JSON request body the router takes (the request
path, the endpoint picker's, and each line of a batch's input file), so what one part accepts no other part
fails on.

Why a limit of its own: each JSON library stops somewhere else. orjson reads 1,024 levels but writes about
254, msgspec stops at Python's recursion limit (which depends on how deep the caller already is), and vLLM's
server reads with Python's ``json``. A batch line nested 300 levels passed validation (orjson's reading) and
then failed each time it was re-encoded for sending. No OpenAI request needs more than a few dozen levels
(a JSON schema in ``response_format`` or a tool's ``parameters`` is the deepest part of one); 128 leaves room
and stays below every library's own limit.

The check is linear and runs in C for all but the deepest brackets: a body with no more opening brackets
than the limit cannot nest deeper than it (two ``bytes.count`` calls, the common case); other bodies have
their strings removed and their innermost pairs peeled a few times (``bytes.replace``), and only what is
still deeper has its brackets summed one by one.
"""

from __future__ import annotations

import operator
from itertools import accumulate, repeat

MAX_JSON_DEPTH = 128  # arrays and objects inside one another, counting the outermost as 1

_STRUCTURE = b'"[]{}'
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in _STRUCTURE)
_PAIRS = bytes.maketrans(b"[{]}", b"(())")  # an array and an object nest alike
_STEPS = bytes.maketrans(b"()", b"\x02\x00")  # an opening bracket: +1, a closing one: -1
_PEELS = 4  # innermost pairs removed in C this many times before the brackets left are summed


def too_deep(document: bytes | bytearray | memoryview, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a JSON ``document`` nests arrays and objects more than ``limit`` deep (brackets inside
    strings do not count). Meant for valid JSON; for invalid JSON the answer means nothing, and the parser
    refuses it anyway."""
    if document.count(b"[") + document.count(b"{") <= limit:
        return False
    data = bytes(document)
    if b"\\" in data:  # escapes read left to right: an escaped backslash, then an escaped quote
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(data.translate(None, _NOT_STRUCTURE).split(b'"')[::2]).translate(_PAIRS)
    peeled = 0
    while brackets and peeled < _PEELS:  # most documents are a few levels deep: gone in a few passes
        brackets = brackets.replace(b"()", b"")
        peeled += 1
    if not brackets:  # each pass took away one level: this many were all
        return peeled > limit
    if brackets.count(b"(") + peeled <= limit:
        return False
    return max(accumulate(map(operator.sub, brackets.translate(_STEPS), repeat(1)))) + peeled > limit


def too_deep_message(limit: int = MAX_JSON_DEPTH) -> str:
    return f"The JSON is nested more than {limit} levels deep (arrays and objects inside one another)."
