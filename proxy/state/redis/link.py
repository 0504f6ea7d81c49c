"""One Redis server as the stores on it see it: its client, a circuit breaker they share, and one thread
for what must not block a request.

Every store on one Redis (the prefix index here, the session table and the response map in
``proxy/state``) keeps a local mirror and answers from it while Redis fails. The first failure of
any of them opens the circuit for all (``up`` turns False, logged once, ``on_state`` told): calls are
then skipped, not tried and timed out one by one. The link's thread probes Redis every
``retry_interval`` seconds; once it answers, each store pushes its mirror back (``on_resync``: Redis
may have restarted empty, and the records it lost, sessions' turn counts among them, must not be
reset) and the circuit closes. A Redis that answers but too slowly to keep up is treated the same way: once
``max_backlog`` writes wait for the link's thread, the circuit opens (the queue then drains at once,
its writes skipped, and the mirrors are pushed back when a probe finds Redis answering), so a
slow Redis bounds this replica's memory and how stale the shared state gets; each time that
happens again before the writes caught up, the circuit stays open twice as long (up to
``MAX_BACKLOG_BACKOFF_S``), so a Redis that stays slow is not sent every mirror every second. A restart quick
enough to cause no failure (the client reconnects on its own) is caught too: while up, the thread
reads Redis's ``run_id`` every ``retry_interval`` and pushes the mirrors back when it changed.
Writes that need no answer go through the same thread, in order.

A probe never runs on an event loop: a caller on one only wakes the thread. A caller without one (a
script, a test) may run the due probe itself and so sees Redis back at once.

The client fails fast: one attempt per call, bounded by the socket timeout (redis-py would otherwise
retry ten times with backoff, and a hung Redis held each call for seconds).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.exceptions import RedisClusterException

from proxy.state.redis.topology import fail_fast

log = logging.getLogger("prefixgate.redis")

T = TypeVar("T")
DEFAULT_RETRY_INTERVAL_S = 1.0
#: Writes waiting for the link's thread past which Redis counts as failing: seconds of writes at
#: thousands of requests a second, a few tens of MB of queued closures.
DEFAULT_MAX_BACKLOG = 50_000
#: The longest the circuit stays open for a Redis that keeps falling behind.
MAX_BACKLOG_BACKOFF_S = 60.0
#: What a Redis call raises when Redis is unreachable, hung, restarting or refusing.
#: (A cluster with no reachable node raises ``RedisClusterException``, which is none of the others.)
ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException, OSError)


def fail_fast_client(url: str, timeout: float) -> redis.Redis:
    """A client whose every call is one attempt of at most ``timeout`` seconds: of one server, a
    Sentinel's master or a Redis Cluster, as ``url`` says (``proxy/state/redis/topology.py``)."""
    client: redis.Redis = fail_fast(url, timeout)
    return client


def on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class RedisLink:
    """The shared client and circuit breaker of the stores on one Redis (see the module docstring)."""

    def __init__(
        self,
        client: redis.Redis,
        retry_interval: float = DEFAULT_RETRY_INTERVAL_S,
        name: str = "redis",
        max_backlog: int = DEFAULT_MAX_BACKLOG,
    ) -> None:
        self.client = client
        self.retry_interval = retry_interval
        self.name = name
        self.max_backlog = max_backlog
        #: Times the backlog overflowed since the writes last caught up (the queue ran empty).
        self.backlog_trips = 0
        self._wrote = False  # a write ran since the last overflow
        self.up = True
        self.failures = 0
        self.resyncs = 0
        self._next_retry = 0.0
        self._on_state: list[Callable[[bool], None]] = []
        self._on_resync: list[Callable[[], None]] = []
        #: (when queued, what to run); None: stop
        self._tasks: queue.SimpleQueue[tuple[float, Callable[[], object]] | None] = queue.SimpleQueue()
        #: Seconds the latest write run waited in the queue: how late other replicas see it.
        self.write_wait_s = 0.0
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._probe_lock = threading.Lock()
        self._closed = False
        #: The Redis process last seen (INFO's run_id): another one means a restart.
        self._run_id: str | None = None
        self._next_check = 0.0

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (a store's own thread on this link then ends)."""
        return self._closed

    def on_state(self, callback: Callable[[bool], None]) -> None:
        """``callback(up)`` when the circuit opens (False) or closes (True); at once with False when
        it is open already (a store made after an earlier call on the link failed, such as the
        index namespace's agreement, would otherwise report Redis up until the circuit closes)."""
        self._on_state.append(callback)
        if not self.up:
            callback(False)

    def on_resync(self, push: Callable[[], None]) -> None:
        """``push()`` (raising on Redis errors) runs before the circuit closes: a store's mirror back."""
        self._on_resync.append(push)

    # -- the breaker ------------------------------------------------------------------------------

    def available(self) -> bool:
        """Whether Redis may be called now (never blocks an event loop; see the module docstring)."""
        if self.up:
            return True
        if time.monotonic() < self._next_retry:
            return False
        if on_event_loop():
            self._wake()
            return False
        return self._probe()

    def call(self, fn: Callable[[], T]) -> T | None:
        """``fn()`` (a Redis call) when the circuit is closed; None when it is open or ``fn`` fails,
        which opens it."""
        if not self.available():
            return None
        if self._thread is None:
            self._ensure_thread()  # from the first use on, it watches for restarts
        try:
            return fn()
        except ERRORS as exc:
            self.failed(exc)
            return None

    def failed(self, exc: BaseException, retry_in: float | None = None) -> None:
        """A call failed: open the circuit (from any thread) for ``retry_in`` seconds (default:
        ``retry_interval``)."""
        self.failures += 1
        self._next_retry = time.monotonic() + (self.retry_interval if retry_in is None else retry_in)
        if not self.up:
            return
        self.up = False
        log.warning(
            "%s failing (%s: %s): every store on it answers from this replica's mirror until it is back",
            self.name,
            type(exc).__name__,
            exc,
        )
        for callback in self._on_state:
            callback(False)
        self._wake()

    def _probe(self) -> bool:
        with self._probe_lock:  # the link's thread and a caller without a loop may both be due
            if self.up:
                return True
            if time.monotonic() < self._next_retry:
                return False
            try:
                self.client.ping()
                for push in self._on_resync:
                    push()
            except Exception as exc:  # a mirror changing under the push too (RuntimeError): next time
                self.failures += 1
                self._next_retry = time.monotonic() + self.retry_interval
                log.debug("%s not back yet: %s: %s", self.name, type(exc).__name__, exc)
                return False
            self.up = True
            self.resyncs += 1
            self._run_id = None  # the mirrors were just pushed: whatever process this is, it has them
        log.info("%s reachable again: mirrors pushed back, shared state in use again", self.name)
        for callback in self._on_state:
            callback(True)
        return True

    # -- the link's thread ------------------------------------------------------------------------

    def submit(self, task: Callable[[], object]) -> None:
        """Run ``task`` (Redis writes) on the link's thread, in submission order; skipped while the
        circuit is open (the mirrors keep what it wrote, pushed back on reconnection). Past
        ``max_backlog`` queued writes the circuit opens: Redis does not keep up."""
        self._ensure_thread()
        tasks = self._tasks
        tasks.put((time.monotonic(), task))
        if self.up and tasks.qsize() > self.max_backlog:
            self.backlog_trips += 1
            self._wrote = False
            backoff = min(MAX_BACKLOG_BACKOFF_S, self.retry_interval * 2 ** (self.backlog_trips - 1))
            self.failed(WriteBacklogFull(f"{tasks.qsize()} writes queued: it does not keep up"), backoff)

    def backlog(self) -> tuple[int, float]:
        """Writes queued for the link's thread now, and how long the latest one run had waited."""
        return self._tasks.qsize(), self.write_wait_s

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every task submitted so far ran (or was skipped)."""
        if self._thread is None:
            return
        marker = _Flush()
        self._tasks.put((time.monotonic(), marker))
        marker.done.wait(timeout)

    def _wake(self) -> None:
        self._ensure_thread()
        self._tasks.put((time.monotonic(), _WAKE))

    def _ensure_thread(self) -> None:
        if self._thread is not None or self._closed:
            return
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self.name}-link", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                item = self._tasks.get(timeout=self.retry_interval)
            except queue.Empty:
                item = (time.monotonic(), _WAKE)
            if item is None:
                return
            queued_at, task = item
            now = time.monotonic()
            if not self.up and now >= self._next_retry:
                self._probe()
            elif self.up and now >= self._next_check:
                self._check_restart()
            if isinstance(task, _Flush):
                self._note_caught_up()  # before the flush returns: it sees whether they caught up
                task.done.set()
            elif task is not _WAKE and self.up:
                self.write_wait_s = now - queued_at
                try:
                    task()
                except ERRORS as exc:
                    self.failed(exc)
                except Exception:  # a bug in one write must not stop the thread every store relies on
                    log.exception("%s: a background write failed", self.name)
                else:
                    self._wrote = True
                    self._note_caught_up()

    def _note_caught_up(self) -> None:
        """Writes ran since the last overflow and none wait: the next overflow backs off from the start."""
        if self.backlog_trips and self._wrote and self.up and self._tasks.empty():
            self.backlog_trips = 0

    def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._tasks.put(None)
            self._thread.join(5.0)
        self.client.close()

    def _check_restart(self) -> None:
        """While up: push the mirrors back when Redis is another process than last time."""
        self._next_check = time.monotonic() + self.retry_interval
        try:
            run_id = str(self.client.info("server").get("run_id"))
        except ERRORS as exc:
            self.failed(exc)
            return
        previous, self._run_id = self._run_id, run_id
        if previous is None or previous == run_id:
            return
        log.warning("%s restarted (a new run_id): pushing this replica's mirrors back", self.name)
        with self._probe_lock:
            try:
                for push in self._on_resync:
                    push()
            except Exception as exc:  # pushed on the next probe instead
                self.failed(exc)
                return
            self.resyncs += 1


class WriteBacklogFull(Exception):
    """More writes wait for the link's thread than ``RedisLink.max_backlog``."""


class _Flush:
    """Set once the link's thread reached it: everything submitted before it is done."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()

    def __call__(self) -> None:
        self.done.set()


def _wake() -> None:
    """The task that wakes the link's thread (to probe) and does nothing else."""


_WAKE = _wake
