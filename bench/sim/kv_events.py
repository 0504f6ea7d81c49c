"""KV-cache events on the wire, as vLLM publishes them (``--kv-events-config``, publisher ``zmq``).

Frames on the PUB socket: ``[topic, seq as 8-byte big-endian, payload]``; the payload is the msgpack
array ``[ts, events, data_parallel_rank]``. vLLM 0.33 encodes each event as a map with a ``type``
key; 0.11 as a positional array whose first item is the type name. Hashes are the uint64 of each
digest's last 8 bytes. The encoder's output equals the payloads in
``shared/specs/vllm_kv_event_payloads.json`` byte for byte.

Replay: a DEALER sends ``[b"", start_seq]`` to the ROUTER replay socket and gets every buffered batch
with ``seq >= start_seq`` as ``[b"", topic, seq, payload]`` (0.11: no topic frame), then the end
marker ``[b"", b"", 0xff * 8, b""]`` (0.11: ``[b"", 0xff * 8, b""]``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from bench.sim.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, PoolEvent
from tokenization.block_hash import kv_event_hash

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
_STOP = object()


_ENCODER = msgspec.msgpack.Encoder()


def _u64(h: bytes | None) -> int | None:
    return None if h is None else kv_event_hash(h)


def _map16(fields: dict[str, Any]) -> msgspec.Raw:
    # vLLM's BlockStored struct has more than 15 fields (most omitted as defaults), so msgspec
    # writes a map16 header even for 9 entries; a plain dict would get a fixmap header.
    body = b"".join(_ENCODER.encode(k) + _ENCODER.encode(v) for k, v in fields.items())
    return msgspec.Raw(b"\xde" + len(fields).to_bytes(2, "big") + body)


def event_v033(event: PoolEvent) -> dict[str, Any] | msgspec.Raw:
    """One event as vLLM 0.33's map (key order and map header as its msgspec structs emit them)."""
    if isinstance(event, BlockStored):
        return _map16(
            {
                "type": "BlockStored",
                "block_hashes": [kv_event_hash(h) for h in event.block_hashes],
                "parent_block_hash": _u64(event.parent_block_hash),
                "token_ids": event.token_ids,
                "block_size": event.block_size,
                "lora_id": None,
                "medium": event.medium,
                "lora_name": None,
                "group_idx": 0,
            }
        )
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [kv_event_hash(h) for h in event.block_hashes],
            "medium": event.medium,
            "group_idx": 0,
        }
    if isinstance(event, AllBlocksCleared):
        # vLLM's own struct has no medium: one is written only for a clear of one tier
        if event.medium is None:
            return {"type": "AllBlocksCleared"}
        return {"type": "AllBlocksCleared", "medium": event.medium}
    raise TypeError(f"not a KV event: {event!r}")


def event_v011(event: PoolEvent) -> list[Any]:
    """One event as vLLM 0.11's positional array."""
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            [kv_event_hash(h) for h in event.block_hashes],
            _u64(event.parent_block_hash),
            event.token_ids,
            event.block_size,
            None,
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [kv_event_hash(h) for h in event.block_hashes], event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"] if event.medium is None else ["AllBlocksCleared", event.medium]
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(
    ts: float, events: Sequence[PoolEvent], data_parallel_rank: int = 0, version: str = "0.33"
) -> bytes:
    """The msgpack payload of one KV event batch for vLLM ``version`` ("0.33" or "0.11")."""
    convert = event_v033 if version == "0.33" else event_v011
    return _ENCODER.encode([float(ts), [convert(e) for e in events], data_parallel_rank])


def _bind(sock: zmq.Socket, host: str, port: int) -> str:
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        sock.bind(f"tcp://{host}:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class KVEventPublisher:
    """ZMQ PUB (and ROUTER replay) publisher running in its own thread.

    ``publish`` is cheap and thread-safe: it queues the events; the thread encodes, numbers and sends
    them, keeps the last ``buffer_steps`` batches for replay and answers replay requests.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        replay_port: int | None = 0,
        topic: str = "kv",
        version: str = "0.33",
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
    ) -> None:
        self.version = version
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bind(self._pub, host, port)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_port is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(self._replay, host, replay_port)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._seq = 0
        self._published = 0
        self._publishing = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{self.endpoint}", daemon=True)
        self._thread.start()

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch published will carry (batches published so far,
        queued ones included: the thread numbers them in the order they were queued, so a reader
        waiting for ``next_seq - 1`` also waits for those the thread has not sent yet)."""
        return self._published

    def publish(self, ts: float, events: list[PoolEvent]) -> None:
        """Queue one batch (no-op when ``events`` is empty)."""
        if events:
            with self._publishing:
                self._published += 1
                self._queue.put((ts, events))

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, stop the thread and close the sockets."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    item = self._queue.get(timeout=0.005)
                except queue.Empty:
                    continue
                if item is _STOP:
                    break
                ts, events = item
                payload = encode_batch(ts, events, self.data_parallel_rank, self.version)
                seq = self._seq.to_bytes(8, "big")
                self._pub.send_multipart((self.topic, seq, payload), copy=False)
                self._buffer.append((self._seq, payload))
                self._seq += 1
        except Exception:  # pragma: no cover - a dying publisher must be visible in logs
            log.exception("KV event publisher failed")
        finally:
            self._pub.close(0)
            if self._replay is not None:
                self._replay.close(0)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid KV event replay request: %r", frames)
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        with_topic = self.version == "0.33"
        for seq, payload in self._buffer:
            if seq >= start_seq:
                head = (client, b"", self.topic) if with_topic else (client, b"")
                self._replay.send_multipart((*head, seq.to_bytes(8, "big"), payload))
        end = (client, b"", b"", END_SEQ, b"") if with_topic else (client, b"", END_SEQ, b"")
        self._replay.send_multipart(end)
