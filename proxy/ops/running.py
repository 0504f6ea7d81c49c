"""What the operator's endpoints (the admin API, the dashboard) read of the running process.

``proxy.gateway.Gateway`` meets it; ``proxy/app.py`` hands the running gateway to the routes. The
routes depend on this protocol rather than on the gateway, which assembles them: the gateway stays at
the top of the imports, and what the operator's side may touch is written down here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from proxy.admission import Admission
    from proxy.config import Settings
    from proxy.explain import Explainer
    from proxy.ops.metrics import Metrics
    from proxy.stages.route import Router
    from proxy.state.backends import StateBackend
    from proxy.state.sessions import Session, SessionTable
    from routing.ranks import Fleet


class Running(Protocol):
    """A running prefixgate process, as its operator's endpoints see it."""

    @property
    def settings(self) -> Settings: ...

    @property
    def fleet(self) -> Fleet: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def state(self) -> StateBackend: ...

    @property
    def sessions(self) -> SessionTable: ...

    @property
    def explainer(self) -> Explainer: ...

    @property
    def admission(self) -> Admission | None:
        """None until the process has started."""

    @property
    def router(self) -> Router | None:
        """None until the process has started."""

    def threads_of(self, key: str) -> list[dict[str, object]]:
        """The threads this process holds for session ``key``."""
        ...

    def end_session(self, key: str) -> Session | None:
        """End a session at once (its seat, its local state, its stored answers' ids)."""
        ...
