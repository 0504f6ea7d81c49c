"""Stage 8, observe: what happened to a request goes to an explicit list of observers.

Events, in this order for every routed request:

- ``placed(ctx, rank)``: ``rank`` holds the request: the plan's first choice once routed, and again
  the rank a retry landed on when that is another;
- ``landed(ctx)``: only for a first turn routed on its head (``ctx.landing``), just before
  ``routed``: its whole prompt's blocks are known now;
- ``prefilled(ctx)``: only for a streamed answer, at once when its stream opened (never deferred by a
  landing): the rank sent its first chunk, which vLLM sends with the first token, after the prefill;
- ``routed(ctx)``: the rank answered (``ctx.rank``): the stream opened, or the whole body arrived;
- ``finished(outcome)``: the request ended: answered, failed on every rank, or its client left.

For a request routed on its head, ``routed`` and ``finished`` wait until its blocks have landed, so
that every observer learns from the whole prompt.

Observers are the stages that learn from answers (the router and its prefix index, admission and
the session table, the prefix-break explainer, the dashboard, the stored-answer pins, the metrics).
Each overrides what it needs of ``Observer``; the pipeline never reaches into one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from proxy.context import Outcome, RequestContext
from proxy.ops.metrics import Metrics
from routing.ranks import Rank

log = logging.getLogger("prefixgate.observe")


class Observer:
    """What an observer may be told; each event does nothing unless overridden."""

    def placed(self, ctx: RequestContext, rank: Rank) -> None:
        """``rank`` holds the request now."""

    def landed(self, ctx: RequestContext) -> None:
        """The whole prompt's blocks of a request routed on its head are on ``ctx`` now."""

    def prefilled(self, ctx: RequestContext) -> None:
        """The rank's prefill of ``ctx`` is done: its stream's first token came, or a request routed
        on its head ended before its whole prompt landed here (a stream may be told both: an
        observer acts on the first)."""

    def routed(self, ctx: RequestContext) -> None:
        """The rank ``ctx.rank`` answered (its stream opened, or its whole body arrived)."""

    def finished(self, outcome: Outcome) -> None:
        """The request ended."""


class Observers:
    """The observers, told in order; one that fails is logged and the others are still told."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = tuple(observers)

    def placed(self, ctx: RequestContext, rank: Rank) -> None:
        self._tell("placed", ctx, rank)

    def landed(self, ctx: RequestContext) -> None:
        self._tell("landed", ctx)

    def prefilled(self, ctx: RequestContext) -> None:
        self._tell("prefilled", ctx)

    def routed(self, ctx: RequestContext) -> None:
        self._tell("routed", ctx)

    def finished(self, outcome: Outcome) -> None:
        self._tell("finished", outcome)

    def _tell(self, event: str, *args: object) -> None:
        for observer in self.observers:
            try:
                getattr(observer, event)(*args)
            except Exception:
                log.exception("%s failed on a %s request", type(observer).__name__, event)


class UsageMetrics(Observer):
    """Counts the tokens the ranks reported (``prefixgate_{prompt,completion,cached}_tokens``)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def finished(self, outcome: Outcome) -> None:
        usage = outcome.usage
        if usage is None or outcome.rank is None:
            return
        metrics, rank = self.metrics, outcome.rank
        metrics.series(metrics.prompt_tokens, rank).inc(usage.prompt_tokens)
        metrics.series(metrics.completion_tokens, rank).inc(usage.completion_tokens)
        if usage.cached_tokens is not None:
            metrics.series(metrics.cached_tokens, rank).inc(usage.cached_tokens)
