"""What one app instance holds: its config, its Redis client and its plan cache."""

from __future__ import annotations

from dataclasses import dataclass

import redis
from flask import current_app

from dashboard.config import DashboardConfig
from dashboard.plan_cache import PlanCache

EXTENSION = "hsx_dashboard"


@dataclass(frozen=True)
class AppState:
    config: DashboardConfig
    redis: redis.Redis
    plans: PlanCache


def current() -> AppState:
    return current_app.extensions[EXTENSION]
