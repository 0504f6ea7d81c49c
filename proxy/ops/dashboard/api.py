"""The dashboard's HTTP routes: the page and the JSON it polls.

- ``GET /dashboard``: the page (``page.html``: hand-written JS and CSS, nothing fetched from outside).
- ``GET /admin/overview[?since=T]``: fleet, hit-rate series after ``T``, ranks, admission.
- ``GET /admin/overview/sessions[?limit=N&sort=F&order=asc|desc&active=1]``: the sessions table.
- ``GET /admin/overview/sessions/{id}``: one session's turns and breaks.

``proxy/auth.py`` guards ``/dashboard`` and ``/admin/*`` with the admin token when one is set; like
``/admin/sessions``, a client key sees only its own sessions here.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.errors import ProxyError, error_response
from proxy.ops.admin import session_of, viewer_of
from proxy.ops.dashboard import views
from proxy.ops.dashboard.stats import Recorder
from proxy.ops.running import Running
from proxy.state.sessions import SORT_FIELDS

MAX_ROWS = 500
#: The page runs inline script and style only and talks to this origin alone: nothing external loads.
CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'"
)
#: The login page only runs its inline script (it navigates to the dashboard itself: no form post).
LOGIN_CSP = CSP.replace("connect-src 'self'", "connect-src 'none'")


def page_html(name: str = "page.html") -> bytes:
    """A page as shipped in the package (the dashboard, or its login page)."""
    return resources.files("proxy.ops.dashboard").joinpath(name).read_bytes()


def login_page(needs: str, refused: bool) -> Response:
    """The 401 a browser gets for ``/dashboard`` without the right credential: a form asking for it
    (``needs``: "admin token" or "API key"; ``refused``: one was sent and not accepted). Only these
    fixed words go into the page."""
    why = LOGIN_WHY.get(needs, LOGIN_WHY["admin token"])
    html = (
        LOGIN_HTML.replace(b"__WHY__", why.encode())
        .replace(b"__NEEDS__", needs.encode())
        .replace(b"__REASON__", b"refused" if refused else b"missing")
    )
    headers = {"content-security-policy": LOGIN_CSP, "cache-control": "no-store"}
    return Response(html, status_code=401, media_type="text/html; charset=utf-8", headers=headers)


LOGIN_HTML = page_html("login.html")
LOGIN_WHY = {
    "admin token": "This dashboard needs the admin token prefixgate was started with "
    "(<code>--admin-token</code>).",
    "API key": "This dashboard needs a client API key (<code>--api-key</code>, "
    "<code>--api-keys-file</code>); it shows that client's sessions.",
}


def _json(data: object) -> Response:
    return Response(orjson.dumps(data), media_type="application/json", headers={"cache-control": "no-store"})


def _bad(message: str, param: str) -> Response:
    return error_response(ProxyError(400, message, param=param, code="invalid_request"))


def dashboard_routes(gateway: Callable[[], Running], recorder: Callable[[], Recorder]) -> list[Route]:
    """Routes over the running ``gateway()`` and the dashboard's ``recorder()``."""
    html = page_html()

    async def dashboard(request: Request) -> Response:
        return Response(
            html,
            media_type="text/html; charset=utf-8",
            headers={"content-security-policy": CSP, "cache-control": "no-store"},
        )

    async def overview(request: Request) -> Response:
        raw = request.query_params.get("since")
        try:
            since = float(raw) if raw is not None else None
        except ValueError:
            return _bad("'since' must be a number (seconds since the epoch)", "since")
        # where the ranks are is the operator's business: their URLs go to the admin only
        return _json(views.overview(gateway(), recorder(), since, show_urls=viewer_of(request) is None))

    async def sessions(request: Request) -> Response:
        params = request.query_params
        sort = params.get("sort", "last_seen")
        if sort not in SORT_FIELDS:
            return _bad(f"'sort' must be one of {', '.join(sorted(SORT_FIELDS))}", "sort")
        order = params.get("order", "desc")
        if order not in ("asc", "desc"):
            return _bad("'order' must be asc or desc", "order")
        try:
            limit = int(params.get("limit", "50"))
        except ValueError:
            return _bad("'limit' must be an integer", "limit")
        if not 1 <= limit <= MAX_ROWS:
            return _bad(f"'limit' must be within 1..{MAX_ROWS}", "limit")
        active_only = params.get("active", "0").lower() in ("1", "true", "yes")
        return _json(
            views.session_rows(
                gateway(),
                viewer=viewer_of(request),
                sort=sort,
                descending=order == "desc",
                limit=limit,
                active_only=active_only,
            )
        )

    async def session(request: Request) -> Response:
        gw = gateway()
        found = session_of(request, gw.sessions, request.path_params["session_id"])
        if isinstance(found, Response):
            return found
        return _json(views.session_detail(gw, recorder(), found))

    return [
        Route("/dashboard", dashboard, methods=["GET"]),
        Route("/admin/overview", overview, methods=["GET"]),
        Route("/admin/overview/sessions", sessions, methods=["GET"]),
        Route("/admin/overview/sessions/{session_id:path}", session, methods=["GET"]),
    ]
