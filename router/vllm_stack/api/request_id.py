"""Request ids: what ``X-Request-Id`` carries when the client sent none."""

from __future__ import annotations

import random


def new_request_id() -> bytes:
    """128 random bits as 32 hex digits (unique, not secret: no need for the OS entropy syscall)."""
    return b"%032x" % random.getrandbits(128)
