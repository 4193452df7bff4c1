"""Request ids: what ``X-Request-Id`` carries when the client sent none."""

from __future__ import annotations

import itertools
import os

# 64 random bits per process, then a counter: unique across router replicas and restarts, and a
# fraction of the cost of drawing 128 random bits per request. Request ids are not secrets.
_PREFIX = os.urandom(8).hex().encode()
_COUNTER = itertools.count(1)


def new_request_id() -> bytes:
    """32 hex digits: this process's random prefix and a sequence number."""
    return b"%s%016x" % (_PREFIX, next(_COUNTER))
