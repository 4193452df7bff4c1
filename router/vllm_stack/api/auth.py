"""Client API keys: ``Authorization: Bearer KEY`` (OpenAI) or ``x-api-key: KEY`` (Anthropic).

Comparison hashes the offered key and compares digests with :func:`hmac.compare_digest` against every
configured key, so timing reveals neither which key matched nor how much of one did. Keys are never
logged; the object's repr hides them.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable


class ApiKeyAuth:
    """Checks client keys; disabled (everything allowed) when no key is configured."""

    __slots__ = ("_digests", "enabled")

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(hashlib.sha256(k.encode()).digest() for k in keys)
        self.enabled = bool(self._digests)  # an attribute, not a property: read once per request

    def __repr__(self) -> str:
        return f"ApiKeyAuth(keys={len(self._digests)})"

    def check(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """True when auth is disabled or the request carries a configured key."""
        if not self._digests:
            return True
        offered = _offered(headers)
        if not offered:
            return False
        digest = hashlib.sha256(offered).digest()
        ok = False
        for known in self._digests:  # no early exit: constant work whatever matches
            ok |= hmac.compare_digest(digest, known)
        return ok

    def holder(self, headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
        """The key a request offered, as the identity its body is counted under (the server's share
        per key); b"" for none; None when auth is disabled. Not checked here: call it for a request
        :meth:`check` passed. Held in memory only while its bodies are, never logged."""
        if not self._digests:
            return None
        return _offered(headers) or b""

    def owner(self, headers: Iterable[tuple[bytes, bytes]]) -> str:
        """Whose the request's stored objects are (the Batch API's files and batches): a digest of its key
        (never the key), so one client cannot list or read another's; "" when auth is disabled."""
        if not self._digests:
            return ""
        offered = _offered(headers)
        return hashlib.sha256(b"vllm-stack owner\0" + (offered or b"")).hexdigest()[:32]


def _offered(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    offered: bytes | None = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                offered = token.strip()
        elif name == b"x-api-key" and offered is None:
            offered = value.strip()
    return offered
