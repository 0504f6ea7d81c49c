"""The live dashboard: ``GET /dashboard`` and the JSON endpoints it and ``prefixgate top`` poll.

``Dashboard`` holds the ``Recorder`` (told by the pipeline's ending: it counts every finished
request) and builds the routes over the running gateway. See ``api.py`` for the routes and
``views.py`` for the documents they return.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.routing import Route

from proxy.ops.dashboard.api import dashboard_routes, page_html
from proxy.ops.dashboard.stats import (
    HIT_RATE_WINDOW,
    SAMPLE_INTERVAL_S,
    SERIES_POINTS,
    HitRateWindow,
    Point,
    Recorder,
    Series,
    Turn,
    TurnLog,
)
from proxy.ops.running import Running
from proxy.state.local import SessionLocals

__all__ = [
    "HIT_RATE_WINDOW",
    "SAMPLE_INTERVAL_S",
    "SERIES_POINTS",
    "Dashboard",
    "HitRateWindow",
    "Point",
    "Recorder",
    "Series",
    "Turn",
    "TurnLog",
    "page_html",
]


class Dashboard:
    """The dashboard of one prefixgate process: its recorder and its routes."""

    def __init__(self, locals_: SessionLocals, *, interval: float = SAMPLE_INTERVAL_S) -> None:
        self.recorder = Recorder(interval=interval, turn_log=TurnLog(locals_))

    def routes(self, gateway: Callable[[], Running]) -> list[Route]:
        """``/dashboard`` and ``/admin/overview*`` over the running gateway."""
        return dashboard_routes(gateway, lambda: self.recorder)
