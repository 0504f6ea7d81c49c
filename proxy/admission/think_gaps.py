"""Think gaps across sessions: how long agents usually stay quiet between an answer and their next request.

Admission judges a session ended once it has been quiet for longer than ``release_factor`` x its own
longest think gap. A session with fewer than ``OWN_EVIDENCE`` gaps says little about itself (a single
short gap, or none at all for a one-request session), so there the population's gaps stand in: the
``quantile`` of recent gaps of every session, a typical agent's long pause.
"""

from __future__ import annotations

from routing.samples import RecentSamples

__all__ = ["OWN_EVIDENCE", "ThinkGaps"]

#: A session with at least this many gaps of its own is judged by them alone.
OWN_EVIDENCE = 3


class ThinkGaps(RecentSamples):
    """Recent think gaps of all sessions (seconds): ``quantile`` is a typical agent's long pause
    (``routing.samples``)."""
