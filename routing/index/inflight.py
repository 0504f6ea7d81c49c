"""Blocks routed to a rank fed by KV events whose events have not arrived yet.

A rank fed by KV events is mirrored from its events alone, and they come after the blocks exist:
vLLM publishes a step's stored blocks once the step ran, and its publisher thread and the feed add
their own delay (hundreds of milliseconds on a busy host, measured on the real-vLLM tier). A request
routed in that window (a second session of the same agent, a wave of sub-agents sharing a head, the
next turn of a fast session) would see nothing of what was just sent there: it scatters to another
rank, and the estimate it gets trails what the rank serves. So routing a prompt to such a rank
records the blocks the rank does not hold yet as in flight there, as llm-d's speculative indexing
and Dynamo's predict-on-route do, and lookups count them after the rank's mirrored prefix until

- the rank's event for the block arrives (``confirm``): the mirror holds it from then on; or
- every request routed with it was prefilled (``prefilled``) longer ago than the feed's lag: its
  event would have come by then, so the rank did not store it (the request failed before its
  prefill, or a copy was evicted at once).

The lag is learned from the traffic: each confirmed block whose requests were all prefilled gives
the time since (one that came sooner gives 0), and the allowance is ``LAG_FACTOR`` x their
``LAG_QUANTILE``, at least ``MIN_ALLOWANCE_S``; before ``MIN_SAMPLES`` of them,
``DEFAULT_ALLOWANCE_S`` (llm-d's default). It is a property of the hosts, not of the traffic's pace,
so a compressed replay needs no scaling of it.

Invariants, per rank and hash: ``requests`` counts the requests routed with the block and not
prefilled yet (>= 0); an entry with ``requests == 0`` has ``since`` (when its last request was
prefilled) and lives until ``since + allowance``; a confirmed entry is gone. An entry is never
counted unless every block before it in the prompt is held or in flight on that rank. Thread-safe:
confirmations come from the feeds' threads.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from routing.samples import RecentSamples

#: Lag samples remembered (the most recent), and how many before the allowance is learned.
LAG_WINDOW = 1000
MIN_SAMPLES = 20
#: The allowance is this many times this quantile of the lags seen, and never below the floor:
#: most events come before their request's first token and teach 0, while a busy host holds some
#: back in bursts (up to ~400 ms on the real-vLLM tier, the siblings investigation in
#: docs/investigations.md) that
#: a fresh window has not seen yet. Counting an unconfirmed block longer costs little: only a
#: request that failed before its prefill leaves one.
LAG_QUANTILE = 0.99
LAG_FACTOR = 2.0
MIN_ALLOWANCE_S = 0.5
DEFAULT_ALLOWANCE_S = 2.0


class InFlightBlocks:
    """Per rank fed by KV events: the blocks routed there whose events have not come yet."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        #: rank -> hash -> [requests not prefilled yet, when the last one was prefilled]
        self._entries: dict[str, dict[bytes, list[float]]] = {}
        #: (when, rank, hashes) of prefilled requests, oldest first: the entries that may expire.
        self._ending: deque[tuple[float, str, Sequence[bytes]]] = deque()
        self._lags = RecentSamples(LAG_WINDOW, MIN_SAMPLES)
        self.confirmed = 0
        self.expired = 0

    def allowance(self) -> float:
        """How long after its last request's prefill an unconfirmed block still counts (seconds;
        read under the lock, or where no feed runs)."""
        lag = self._lags.quantile(LAG_QUANTILE)
        return DEFAULT_ALLOWANCE_S if lag is None else max(LAG_FACTOR * lag, MIN_ALLOWANCE_S)

    def add(self, rank: str, hashes: Sequence[bytes]) -> Sequence[bytes]:
        """A request routed to ``rank`` will store ``hashes`` there (the prompt's blocks past what
        the rank holds); returns them, for ``prefilled``."""
        if not hashes:
            return hashes
        with self._lock:
            entries = self._entries.setdefault(rank, {})
            for h in hashes:
                entry = entries.get(h)
                if entry is None:
                    entries[h] = [1, 0.0]
                else:
                    entry[0] += 1
            self._sweep(self._clock())
        return hashes

    def prefilled(self, rank: str, hashes: Sequence[bytes]) -> None:
        """The request ``add`` was given ``hashes`` for was prefilled (or ended without): its blocks'
        events are due within the allowance."""
        if not hashes:
            return
        now = self._clock()
        with self._lock:
            entries = self._entries.get(rank)
            if entries is not None:
                for h in hashes:
                    entry = entries.get(h)
                    if entry is not None and entry[0] > 0:
                        entry[0] -= 1
                        if entry[0] == 0:
                            entry[1] = now
                self._ending.append((now, rank, hashes))
            self._sweep(now)

    def confirm(self, rank: str, hashes: Sequence[bytes]) -> None:
        """``rank``'s events say it stored ``hashes``: the mirror holds them now (a feed's thread)."""
        if rank not in self._entries:  # nothing in flight there: no lock for the feed's every batch
            return
        now = self._clock()
        with self._lock:
            entries = self._entries.get(rank)  # read again: a sweep may have dropped the table
            if entries is None:
                return
            for h in hashes:
                entry = entries.pop(h, None)
                if entry is None:
                    continue
                self.confirmed += 1
                self._lags.add(max(now - entry[1], 0.0) if entry[0] == 0 else 0.0)
            self._drop_if_empty(rank, entries)

    def extend(self, hashes: Sequence[bytes], matches: dict[str, int]) -> None:
        """Lengthen each rank's held prefix of ``hashes`` in ``matches`` by the blocks in flight to it
        that follow (a rank holding none may then hold some)."""
        if not self._entries or not hashes:
            return
        with self._lock:  # the lags change under it (a feed's thread)
            deadline = self._clock() - self.allowance()
            for rank, entries in self._entries.items():
                held = start = matches.get(rank, 0)
                while held < len(hashes):
                    entry = entries.get(hashes[held])
                    if entry is None or (entry[0] == 0 and entry[1] < deadline):
                        break
                    held += 1
                if held > start:
                    matches[rank] = held

    def size(self) -> int:
        """Blocks in flight on every rank (expired ones not swept yet included)."""
        with self._lock:
            return sum(len(entries) for entries in self._entries.values())

    def _sweep(self, now: float) -> None:
        """Drop the entries whose requests were all prefilled longer than the allowance ago."""
        ending, deadline = self._ending, now - self.allowance()
        while ending and ending[0][0] < deadline:
            _, rank, hashes = ending.popleft()
            entries = self._entries.get(rank)
            if entries is None:
                continue
            for h in hashes:
                entry = entries.get(h)
                if entry is not None and entry[0] == 0 and entry[1] < deadline:
                    del entries[h]
                    self.expired += 1
            self._drop_if_empty(rank, entries)

    def _drop_if_empty(self, rank: str, entries: dict[bytes, list[float]]) -> None:
        """Forget a rank with nothing in flight (under the lock), so that lookups while every block
        is confirmed find no entries at all and take no lock."""
        if not entries and self._entries.get(rank) is entries:
            del self._entries[rank]
