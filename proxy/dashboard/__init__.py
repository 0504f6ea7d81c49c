"""The live dashboard (issue 9): ``GET /dashboard`` and the JSON endpoints it and ``prefixgate top`` poll.

Wiring (``proxy/app.py``)::

    gateway.dashboard = Dashboard(gateway.sessions.fleet)   # in Gateway.__init__
    gateway.dashboard.attach(gateway.admission)             # in Gateway.start, once admission exists
    app.include_router(gateway.dashboard.router(lambda: gateway))

``attach`` hooks the recorder behind ``Admission.observed`` (the call the pipeline makes once per
answered request, with the session and the rank's usage), so the dashboard sees every answer without
a stage of its own. See ``api.py`` for the routes and ``views.py`` for the documents they return.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter

from proxy.dashboard.api import dashboard_router, page_html
from proxy.dashboard.stats import SAMPLE_INTERVAL_S, SERIES_POINTS, Point, Recorder, Series, Turn, TurnLog

if TYPE_CHECKING:
    from proxy.admission import Admission
    from proxy.app import Gateway
    from proxy.context import RequestContext
    from proxy.observe import Usage

__all__ = [
    "SAMPLE_INTERVAL_S",
    "SERIES_POINTS",
    "Dashboard",
    "Point",
    "Recorder",
    "Series",
    "Turn",
    "TurnLog",
    "page_html",
]


class Dashboard:
    """The dashboard of one prefixgate process: its recorder and its routes."""

    def __init__(self, fleet_window: Any, *, interval: float = SAMPLE_INTERVAL_S) -> None:
        self.recorder = Recorder(fleet_window, interval=interval)

    def attach(self, admission: Admission) -> None:
        """Record every answer ``admission.observed`` is told about (after admission has counted it)."""
        original = admission.observed
        recorder = self.recorder

        def observed(ctx: RequestContext, backend: str, usage: Usage | None) -> None:
            original(ctx, backend, usage)
            session = ctx.session
            key = getattr(session, "key", None)
            turns = getattr(session, "turns", 0)
            recorder.observed(
                backend,
                usage.prompt_tokens if usage is not None else None,
                usage.cached_tokens if usage is not None else None,
                session=key,
                # the explainer numbers a session's turns from 0; admission counts them from 1
                turn=turns - 1 if key is not None else None,
                estimated_cached_tokens=ctx.estimated_cached_tokens,
                completion_tokens=usage.completion_tokens if usage is not None else None,
            )

        admission.observed = observed  # type: ignore[method-assign]
        release = admission.release

        def released(key: str) -> Any:
            recorder.turns.forget(key)
            return release(key)

        admission.release = released  # type: ignore[method-assign]

    def router(self, gateway: Callable[[], Gateway]) -> APIRouter:
        """``/dashboard`` and ``/admin/overview*`` over the running gateway."""
        return dashboard_router(gateway, lambda: self.recorder)
