"""Who sent a request: its tenant's name, resolved once as the request is parsed.

In this order:

1. **Client keys configured** (``api_keys_file`` / ``VLLM_STACK_API_KEYS``): the name of the key the
   request offered. A keys-file line ``NAME: KEY`` names its key (a name, a colon, whitespace, the
   key: a bearer token holds neither whitespace nor needs one, so no key of an older file reads as
   named). A line with the key alone, as every file before tenants had, is its own tenant under a
   stable name that is not the key (``key-`` and 12 hex digits of a salted SHA-256 of it), so old
   deployments with a key per client get fairness per client without editing the file. With keys on,
   the header below is ignored: the key is what the router checked, a header anyone can write.
2. **No keys**: the fairness header (the ``tenant_header`` setting, by default llm-d's
   ``x-llm-d-inference-fairness-id``; with that default the Inference Extension's
   ``x-gateway-inference-fairness-id`` is read too, as llm-d reads its deprecated alias), its value as
   UTF-8, at most 64 characters kept. The configured header decides over the alias whatever their
   order, and a header sent twice by its first value: a client cannot append a second one to override
   what a gateway in front wrote. A header configured other than llm-d's is the only one read (the
   operator's gateway writes that one; llm-d's, which it may pass through, would let a client name any
   tenant).
3. Otherwise one shared tenant, ``default``.

The key itself is never kept past the lookup, logged or used as a label.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

#: The tenant of a request nothing names (no key, no header).
DEFAULT_TENANT = "default"
#: The metric label of every tenant that is not declared (bounded labels).
OTHER_TENANTS = "other"
#: llm-d's fairness header, and its deprecated alias from the Gateway API Inference Extension.
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
FAIRNESS_HEADER_ALIAS = "x-gateway-inference-fairness-id"
#: The longest tenant name kept from a header (a longer value is cut there).
MAX_NAME = 64

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NAMED_KEY = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]{0,63}):\s+(\S+)")


def valid_name(name: str) -> bool:
    """A tenant name a declaration or a keys file may use: 1-64 of letters, digits, ``.``, ``_``, ``-``."""
    return _NAME.fullmatch(name) is not None


def split_key_line(line: str) -> tuple[str, str | None]:
    """A keys-file line (stripped, not a comment) as (key, its name or None)."""
    named = _NAMED_KEY.fullmatch(line)
    if named is None:
        return line, None
    return named.group(2), named.group(1)


def unnamed_key_tenant(key: bytes) -> str:
    """The tenant of a key its file does not name: stable across restarts and replicas, not the key."""
    return "key-" + hashlib.sha256(b"vllm-stack tenant\0" + key).hexdigest()[:12]


class TenantIdentity:
    """Resolves a request's tenant (the module's rules), built from one configuration.

    ``headers``: the header names the API layer collects the fairness id from as it scans a
    request's headers, each with its rank (0 decides over 1; among equals the first sent); empty when
    keys decide, so that scan takes nothing then."""

    __slots__ = ("keyed", "headers", "_names")

    def __init__(self, key_names: Mapping[str, str], keys_on: bool, header: str = FAIRNESS_HEADER) -> None:
        self.keyed = keys_on
        self._names = {hashlib.sha256(k.encode()).digest(): n for k, n in key_names.items()}
        configured = header.lower().encode("latin-1")
        ranks = {configured: 0}
        if configured == FAIRNESS_HEADER.encode():
            ranks[FAIRNESS_HEADER_ALIAS.encode()] = 1
        self.headers: Mapping[bytes, int] = {} if keys_on else ranks

    def __repr__(self) -> str:  # never the keys, nor their digests
        return f"TenantIdentity(keyed={self.keyed}, named_keys={len(self._names)})"

    def of_key(self, key: bytes | None) -> str:
        """The tenant of a request that offered ``key`` (checked valid by the API key check)."""
        if not key:
            return DEFAULT_TENANT
        name = self._names.get(hashlib.sha256(key).digest())
        return name if name is not None else unnamed_key_tenant(key)

    @staticmethod
    def of_header(value: bytes) -> str:
        """The tenant a fairness header names (its value, trimmed, as UTF-8 (a byte that is not: U+FFFD),
        at most :data:`MAX_NAME` characters; empty: the shared tenant)."""
        name = value.strip()[: 4 * MAX_NAME].decode("utf-8", "replace")[:MAX_NAME]
        return name or DEFAULT_TENANT
