"""A client of LMCache's controller (``lmcache_controller``, LMCache 0.5.x): where a prompt's KV is.

The controller hears from every engine's LMCache worker which KV chunks that instance holds (in its
CPU or disk cache, or wherever LMCache put them); its ``POST /lookup {"tokens": [...]}`` cuts the token
ids into LMCache's 256-token chunks, hashes them as the workers do (so ``PYTHONHASHSEED`` must be the
same on the controller and the engines; the chart sets one value) and answers, per instance, the end
of the longest run of leading chunks found there: ``{"layout_info": {instance: [location, tokens]}}``.

This client asks on the request path, so it is bounded: a timeout per lookup, an answer of at most
:data:`MAX_ANSWER_BYTES`, and after a failure no lookups for :attr:`LmcacheController.backoff` seconds
(a controller that is down costs each request nothing, not a timeout each).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

log = logging.getLogger(__name__)

MAX_ANSWER_BYTES = 1 << 20  # a lookup answer names a few instances; more is not a controller's answer


class LookupFailed(Exception):
    """The controller could not be asked, did not answer in time, or answered something unusable."""

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome  # the metric's label: error, timeout, bad_answer, backoff


@dataclass(frozen=True, slots=True)
class Holder:
    """The instance holding the longest leading run of the prompt's chunks, and how far it goes."""

    instance: str
    location: str
    tokens: int


class LmcacheController:
    """Asks one controller's ``/lookup``; one HTTP session, opened on first use and closed by :meth:`aclose`."""

    def __init__(self, url: str, timeout: float = 0.2, backoff: float = 2.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.backoff = backoff
        self._session: aiohttp.ClientSession | None = None
        self._quiet_until = 0.0  # no lookups before this (time.monotonic) after a failure

    async def lookup(self, tokens: Sequence[int]) -> Holder | None:
        """The best holder of ``tokens``' leading chunks, or None when no instance holds the first one."""
        if time.monotonic() < self._quiet_until:
            raise LookupFailed("backoff", "the controller failed recently")
        try:
            return await asyncio.wait_for(self._ask(tokens), self.timeout)
        except LookupFailed as exc:
            self._failed(exc)
            raise
        except TimeoutError:
            exc = LookupFailed("timeout", f"no answer within {self.timeout:g}s")
        except (aiohttp.ClientError, OSError) as err:
            exc = LookupFailed("error", f"{type(err).__name__}: {err}")
        self._failed(exc)
        raise exc

    async def _ask(self, tokens: Sequence[int]) -> Holder | None:
        session = self._session
        if session is None or session.closed:
            session = self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64), cookie_jar=aiohttp.DummyCookieJar()
            )
        body = orjson.dumps({"tokens": list(tokens)})
        headers = {"content-type": "application/json"}
        async with session.post(self.url + "/lookup", data=body, headers=headers) as resp:
            answer = await resp.content.read(MAX_ANSWER_BYTES + 1)
            if resp.status != 200:
                raise LookupFailed("error", f"the controller answered {resp.status}: {answer[:200]!r}")
        if len(answer) > MAX_ANSWER_BYTES:
            raise LookupFailed("bad_answer", "the controller's answer is over 1 MiB")
        return best_holder(answer)

    def _failed(self, exc: LookupFailed) -> None:
        self._quiet_until = time.monotonic() + self.backoff
        log.warning("LMCache controller lookup at %s failed (%s); none for %gs", self.url, exc, self.backoff)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def best_holder(answer: bytes) -> Holder | None:
    """The holder reaching furthest in a ``/lookup`` answer (ties: the instance id, so every router
    replica picks the same); :class:`LookupFailed` when the answer is not that shape."""
    try:
        layout = orjson.loads(answer)["layout_info"]
        holders = [Holder(str(i), str(loc), int(n)) for i, (loc, n) in layout.items()]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
        raise LookupFailed("bad_answer", f"not a lookup answer: {err}") from None
    if not holders:
        return None
    return max(holders, key=lambda h: (h.tokens, h.instance))
