"""Redis must never evict hsx's keys: the plan, manifest and ledger have no copy elsewhere in Redis.

Under ``allkeys-lru`` (a common default of managed and cache-sized Redis) Redis
evicted a run's plan and manifest mid-run and the workers blamed a restart.
Every role checks the policy at start: anything but
``noeviction`` is refused with the fix. Where ``CONFIG GET`` is not permitted
(managed Redis renames or forbids it) the role warns once and goes on.
"""

from __future__ import annotations

import logging

import redis

from hsx.errors import HsxError

log = logging.getLogger(__name__)
REQUIRED = "noeviction"
_warned = False


class EvictingRedis(HsxError, RuntimeError):
    """Redis runs with a maxmemory-policy that may evict hsx's keys."""


def check_eviction_policy(r: redis.Redis, where: str = "Redis") -> str | None:
    """The policy Redis reports (None when it will not say); EvictingRedis unless it is noeviction."""
    global _warned
    try:
        raw = r.config_get("maxmemory-policy")
    except redis.ResponseError as exc:  # CONFIG disabled or not permitted for this user
        if not _warned:
            log.warning("cannot read %s's maxmemory-policy (%s); make sure it is `%s`, or Redis may evict the "
                        "run's plan and ledger under memory pressure", where, exc, REQUIRED)
            _warned = True
        return None
    policy = raw.get("maxmemory-policy") if isinstance(raw, dict) else None
    if isinstance(policy, bytes):
        policy = policy.decode()
    if policy is None:
        return None
    if policy != REQUIRED:
        raise EvictingRedis(f"{where} runs with maxmemory-policy {policy}, which evicts keys (a run's plan and "
                            f"ledger) under memory pressure; set `maxmemory-policy {REQUIRED}` (redis.conf, or "
                            f"CONFIG SET maxmemory-policy {REQUIRED}) and start again")
    return policy
