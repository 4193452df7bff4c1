"""Request ids: what ``X-Request-Id`` carries when the client sent none."""

from __future__ import annotations

import itertools
import os
import re

# 64 random bits per process, then a counter: unique across router replicas and restarts, and a
# fraction of the cost of drawing 128 random bits per request. Request ids are not secrets.
_PREFIX = os.urandom(8).hex().encode()
_COUNTER = itertools.count(1)


def new_request_id() -> bytes:
    """32 hex digits: this process's random prefix and a sequence number."""
    return b"%s%016x" % (_PREFIX, next(_COUNTER))


#: What a client's ``X-Request-Id`` may be to be used as the request's id (echoed, forwarded, logged):
#: short and plain. Anything else (60 KB, raw bytes, CR/LF) is replaced by a new id.
_VALID = re.compile(rb"[A-Za-z0-9._:+/=@-]{1,128}")


def valid_request_id(value: bytes) -> bool:
    return _VALID.fullmatch(value) is not None
