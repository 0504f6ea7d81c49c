"""The admin API over the session table: list, show and end sessions (``/admin/sessions``).

Guarded by ``proxy/auth.py``: with the admin token every session is visible; a client key sees only
its own sessions (those recorded with its label). Session keys are namespaced by client
(``proxy/tenants.py``): a session's ``id`` is the key its client sent, and its ``client`` says whose
it is. A client addresses its own sessions by their ids; the admin by id when only one client has
such a session, else as ``<client>/<id>``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.errors import ProxyError, error_response
from proxy.ops.running import Running
from proxy.state.sessions import SORT_FIELDS, Session, SessionTable
from proxy.tenants import client_view, tenant_key

MAX_PAGE = 1000


def _json(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def viewer_of(request: Request) -> str | None:
    """None: sees every session (admin); else the client label whose sessions alone are visible."""
    state = request.scope.get("state") or {}
    if state.get("is_admin", True):
        return None
    return state.get("client_label") or ""


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ProxyError(400, f"'{name}' must be an integer", param=name, code="invalid_request") from None
    if not low <= value <= high:
        raise ProxyError(400, f"'{name}' must be within {low}..{high}", param=name, code="invalid_request")
    return value


def session_not_found(session_id: str) -> Response:
    """The 404 for a session that is unknown or not the viewer's."""
    return error_response(ProxyError(404, f"no session {session_id!r}", code="session_not_found"))


def ambiguous_session(session_id: str, found: list[Session]) -> Response:
    """The 409 for an id that sessions of several clients have: the admin must name the client."""
    choices = ", ".join(sorted(repr(s.key) for s in found))
    message = f"several clients have a session {session_id!r}: ask for one of {choices}"
    return error_response(ProxyError(409, message, code="ambiguous_session"))


def session_of(request: Request, table: SessionTable, session_id: str) -> Session | Response:
    """The session the caller means by ``session_id`` (see the module docstring), or the 404/409."""
    viewer = viewer_of(request)
    if viewer is not None:
        mine = table.get(tenant_key(viewer or None, session_id))
        return mine if mine is not None and mine.client == (viewer or None) else session_not_found(session_id)
    exact = table.get(session_id)
    if exact is not None:
        return exact
    keys = getattr(request.app.state, "keys", None)
    labels = [key.label for key in keys.keys] if keys is not None else []
    found = [s for s in (table.get(tenant_key(label, session_id)) for label in labels) if s is not None]
    if not found:
        return session_not_found(session_id)
    return found[0] if len(found) == 1 else ambiguous_session(session_id, found)


def admin_routes(
    gateway: Callable[[], Running], turn_log: Callable[[str], list[dict[str, Any]]]
) -> list[Route]:
    """Routes for ``/admin/sessions`` over the running ``gateway()``; ``turn_log(key)``: a session's
    turns as the dashboard logged them."""

    async def list_sessions(request: Request) -> Response:
        """``?sort=FIELD&order=asc|desc&offset=N&limit=N&active=1``: a page of the table."""
        params = request.query_params
        sort = params.get("sort", "last_seen")
        order = params.get("order", "desc")
        if sort not in SORT_FIELDS:
            fields = ", ".join(sorted(SORT_FIELDS))
            return error_response(ProxyError(400, f"'sort' must be one of {fields}", param="sort"))
        if order not in ("asc", "desc"):
            return error_response(ProxyError(400, "'order' must be asc or desc", param="order"))
        try:
            offset = _int_param(request, "offset", 0, 0, 1 << 31)
            limit = _int_param(request, "limit", 50, 1, MAX_PAGE)
        except ProxyError as exc:
            return error_response(exc)
        active_only = params.get("active", "0").lower() in ("1", "true", "yes")
        gw = gateway()
        page = gw.sessions.page(
            sort=sort,
            descending=order == "desc",
            offset=offset,
            limit=limit,
            active_only=active_only,
            client=viewer_of(request),
        )
        now = gw.sessions.clock()
        ttl = gw.sessions.idle_ttl
        return _json(
            {
                "object": "list",
                "total": page.total,
                "offset": offset,
                "limit": limit,
                "sort": sort,
                "order": order,
                "data": [_row(s, now, ttl, with_breaks=False) for s in page.sessions],
            }
        )

    async def show_session(request: Request) -> Response:
        """The session's record with its breaks, its turn log and its threads (this replica's)."""
        session_id = request.path_params["session_id"]
        gw = gateway()
        table = gw.sessions
        session = session_of(request, table, session_id)
        if isinstance(session, Response):
            return session
        row = _row(session, table.clock(), table.idle_ttl, with_breaks=True)
        # Redis loads a record without its breaks: this replica's explainer has the recent ones
        row["breaks"] = session.breaks or gw.explainer.breaks(session.key)
        row["turns_log"] = turn_log(session.key)
        row["threads"] = gw.threads_of(session.key)
        return _json(row)

    async def end_session(request: Request) -> Response:
        """End a session at once: its working set no longer counts against its rank's budget."""
        session_id = request.path_params["session_id"]
        gw = gateway()
        session = session_of(request, gw.sessions, session_id)
        if isinstance(session, Response):
            return session
        gw.end_session(session.key)
        return _json({"id": session_id, "object": "session", "deleted": True})

    return [
        Route("/admin/sessions", list_sessions, methods=["GET"]),
        Route("/admin/sessions/{session_id:path}", show_session, methods=["GET"]),
        Route("/admin/sessions/{session_id:path}", end_session, methods=["DELETE"]),
    ]


def _row(session: Session, now: float, idle_ttl: float, with_breaks: bool) -> dict[str, object]:
    """A session as the admin API shows it: ``breaks`` is always the list of break records (only in
    a single session's answer), ``break_count`` their number (in every row)."""
    data = session.to_dict()
    breaks = data.pop("breaks")
    data["break_count"] = len(breaks)
    if with_breaks:
        data["breaks"] = breaks
    elif session.admission is not None:
        # a page of the table: the decision's summary, the detail is per session
        data["admission"] = {k: session.admission.get(k) for k in ("decision", "waited_s", "rank")}
    data["id"] = client_view(session.key, session.client)  # "key" stays the admin's unique name
    data["active"] = session.is_active(now, idle_ttl)
    return data
