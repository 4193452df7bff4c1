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
than the limit cannot nest deeper than it (one ``bytes.translate`` pass, about 0.3 ns a byte here, 0.9 us
for a 2 KB body: the common case; a body of at most 257 bytes is not even scanned); other bodies have
their strings removed and their innermost pairs peeled (``bytes.replace``, while a pass takes a quarter
away at least), and only what is still deeper is summed, run of brackets by run. Bodies built to defeat
this cost more: measured here, 24 MB of them 0.2-0.5 s, where such a body costs the router tens of ms
otherwise.
"""

from __future__ import annotations

import operator
import re
from itertools import accumulate

MAX_JSON_DEPTH = 128  # arrays and objects inside one another, counting the outermost as 1

_STRUCTURE = b'"[]{}'
_NOT_OPENING = bytes(b for b in range(256) if b not in b"[{")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in _STRUCTURE)
_PAIRS = bytes.maketrans(b"[{]}", b"(())")  # an array and an object nest alike
_PEELS = 16  # innermost pairs removed in C at most this many times before the runs left are summed
_RUNS = re.compile(rb"\(+|\)+")


def too_deep(document: bytes | bytearray | memoryview, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a JSON ``document`` nests arrays and objects more than ``limit`` deep (brackets inside
    strings do not count). Meant for valid JSON; for invalid JSON the answer means nothing, and the parser
    refuses it anyway."""
    if len(document) <= 2 * limit + 1:  # too short to hold more than ``limit`` pairs of brackets
        return False
    data = document if isinstance(document, bytes) else bytes(document)
    if len(data.translate(None, _NOT_OPENING)) <= limit:  # one pass in C: the common body ends here
        return False
    if b"\\" in data:  # escapes read left to right: an escaped backslash, then an escaped quote
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(data.translate(None, _NOT_STRUCTURE).split(b'"')[::2]).translate(_PAIRS)
    peeled = 0
    while brackets and peeled < _PEELS:  # real documents are a few levels deep: gone in a few passes
        before = len(brackets)
        brackets = brackets.replace(b"()", b"")
        peeled += 1
        if len(brackets) * 4 > before * 3:  # a pass that takes little away: the runs are cheaper now
            break
    if not brackets:  # each pass took away one level: this many were all
        return peeled > limit
    if brackets.count(b"(") + peeled <= limit:
        return False
    # What is left alternates runs of openings and closings (a pass took little away: few leaves, so
    # long runs): the depth after each run of openings, summed run by run in C.
    runs = list(map(len, _RUNS.findall(brackets)))
    opened = accumulate(runs[0::2])
    closed = accumulate(runs[1::2], initial=0)
    return max(map(operator.sub, opened, closed)) + peeled > limit


def too_deep_message(limit: int = MAX_JSON_DEPTH) -> str:
    return f"The JSON is nested more than {limit} levels deep (arrays and objects inside one another)."
