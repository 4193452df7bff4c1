"""The rate limits' shared store: every router replica's buckets in one Redis, decided by one script.

Why it is exact across replicas: a decision is one Lua script (:data:`SCRIPT`) that Redis runs
atomically: it reads the tenant's buckets, refills them by the time since their stamp, decides, takes
and writes back with no other command in between, and "now" is Redis's own clock (``TIME``), so the
replicas' clocks never enter and two replicas can never both spend the same capacity. The arithmetic is
:mod:`.ratelimit`'s, line for line (its tests check both against the same numbers). A tenant's hash
expires once its buckets would be full again, so idle tenants cost no memory.

The ``redis`` package (redis.asyncio) is imported only when a store address is set.
"""

from __future__ import annotations

from typing import Any

from vllm_stack.tenants.ratelimit import MAX_DEBT_MINUTES, Decision, TenantLimits, _decision

#: Keys are this prefix and the tenant's name (hash fields: see :data:`SCRIPT`).
KEY_PREFIX = "vllm-stack:ratelimit:"
#: Seconds a decision may take before the store counts as failing (the request must not wait long; the
#: router's ``rate_limit_store_timeout``).
TIMEOUT = 0.5

#: Connections one router keeps to the store at most: a decision holds one for its round trip, so with
#: Redis slow the pool would otherwise open one per request in flight; beyond this a decision waits for a
#: free one (within the timeout, then fails open like any other failure of the store).
MAX_CONNECTIONS = 64

#: The longest a tenant's hash is kept (seconds until full; its TTL): the levels are bounded (one
#: request per request, one minute of debt per token), so this only guards against a stored level from
#: elsewhere turning PEXPIRE's argument into nonsense (a float's exponent, which Redis refuses).
MAX_FULL_SECONDS = 3600

# KEYS[1]: the tenant's hash (r, t: levels; s: stamp; lr, lt: the limits they were filled under: a
# changed limit starts its bucket full, and a correction made under the old limits is dropped). ARGV: rpm, tpm (-1: not limited), tokens, mode ("take"; "adjust": take
# ``tokens`` more from the token bucket, a refund when negative). Returns {allowed, wait, req, tok} as
# strings (a Lua number would come back truncated to an integer).
SCRIPT = """
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local v = redis.call('HMGET', KEYS[1], 'r', 't', 's', 'lr', 'lt')
local req, tok, stamp = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
if stamp == nil then
  req, tok, stamp = math.max(rpm, 0), math.max(tpm, 0), now
else
  if tonumber(v[4]) ~= rpm then req = math.max(rpm, 0) end
  if tonumber(v[5]) ~= tpm then
    if ARGV[4] == 'adjust' then return {0, '0', tostring(req), tostring(tok)} end
    tok = math.max(tpm, 0)
  end
end
local function refill(level, limit)
  return math.min(limit, level + math.max(0, now - stamp) * limit / 60)
end
local function floor_debt(level)
  return math.max(level, -DEBT * tpm)
end
local wait = 0
if rpm >= 0 then
  req = refill(req, rpm)
  wait = math.max(wait, math.max(0, 1 - req) * 60 / rpm)
end
local allowed = 0
if ARGV[4] == 'adjust' then
  if tpm >= 0 then tok = floor_debt(math.min(tpm, refill(tok, tpm) - n)) end
else
  if tpm >= 0 then
    tok = refill(tok, tpm)
    wait = math.max(wait, math.max(0, math.min(n, tpm) - tok) * 60 / tpm)
  end
  if wait == 0 then
    allowed = 1
    if rpm >= 0 then req = req - 1 end
    if tpm >= 0 then tok = floor_debt(tok - n) end
  end
end
local full = 0
if rpm > 0 then full = math.max(full, (rpm - req) * 60 / rpm) end
if tpm > 0 then full = math.max(full, (tpm - tok) * 60 / tpm) end
local ttl = math.floor(math.min(math.max(full, 0), MAX_FULL) * 1000) + 1000
redis.call('HSET', KEYS[1], 'r', tostring(req), 't', tostring(tok), 's', tostring(now),
  'lr', tostring(rpm), 'lt', tostring(tpm))
redis.call('PEXPIRE', KEYS[1], string.format('%d', ttl))
return {allowed, tostring(wait), tostring(req), tostring(tok)}
""".replace("MAX_FULL", str(MAX_FULL_SECONDS)).replace("DEBT", str(MAX_DEBT_MINUTES))


class RedisBuckets:
    """The buckets in Redis at ``url`` (``redis://[:password@]host:port/db``, ``rediss://`` for TLS)."""

    __slots__ = ("_client", "_script", "url")

    def __init__(self, url: str, timeout: float = TIMEOUT) -> None:
        import redis.asyncio  # noqa: PLC0415 - only with a shared store configured

        self.url = url
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=timeout,  # waiting for a free connection
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            health_check_interval=30,
        )
        self._client: Any = redis.asyncio.Redis.from_pool(pool)  # closing the client closes the pool
        self._script = self._client.register_script(SCRIPT)

    async def take(self, tenant: str, limits: TenantLimits, tokens: int) -> Decision:
        """As :meth:`LocalBuckets.take`, decided by Redis; raises the client's error when it fails."""
        allowed, wait, req, tok = await self._run(tenant, limits, tokens, "take")
        return _decision(
            bool(int(allowed)), float(wait), limits, float(req), float(tok), tokens if int(allowed) else 0
        )

    async def adjust(self, tenant: str, limits: TenantLimits, delta: int) -> None:
        """As :meth:`LocalBuckets.adjust`."""
        if limits.tokens_per_minute is not None and delta != 0:
            await self._run(tenant, limits, delta, "adjust")

    async def _run(self, tenant: str, limits: TenantLimits, tokens: int, mode: str) -> list[Any]:
        rpm = limits.requests_per_minute
        tpm = limits.tokens_per_minute
        return await self._script(
            keys=[KEY_PREFIX + tenant],
            args=[-1 if rpm is None else rpm, -1 if tpm is None else tpm, tokens, mode],
        )

    async def close(self) -> None:
        await self._client.aclose()
