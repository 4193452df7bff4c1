"""Which headers cross the router, in which direction (RFC 9110 section 7.6.1)."""

from __future__ import annotations

from collections.abc import Iterator

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
#: Request headers the router sets itself towards the engine, or that must not leak to it
#: (the client's own credentials; the engines get the router's key instead).
REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"expect", b"authorization", b"x-api-key"}

_NOTHING: frozenset[bytes] = frozenset()


def header_fields(block: bytes) -> Iterator[tuple[bytes, bytes]]:
    """The (name, value) pairs of CRLF-separated ``name: value`` header lines, each part stripped (the
    lines a plugin or the rate limits add, a provider's own); a line without a colon, such as the empty
    one after the last CRLF, is skipped."""
    for line in block.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep:
            yield name.strip(), value.strip()


def connection_listed(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names that a `Connection` header declares hop-by-hop.

    Such headers are meant for this hop only and must not be forwarded. Almost every message lists
    nothing beyond keep-alive/close, so the common result is the shared empty set.
    """
    listed: set[bytes] = set()
    for key, value in headers:
        if key.lower() == b"connection":
            listed.update(token.strip().lower() for token in value.split(b","))
    listed -= {b"", b"close", b"keep-alive"}
    return frozenset(listed) if listed else _NOTHING
