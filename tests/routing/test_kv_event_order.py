"""The order of a rank's KV-event batches: copies a replay applied, gaps, restarts, a bad batch."""

from __future__ import annotations

import threading

import msgspec
import zmq

from routing.index.memory import MemoryPrefixIndex
from routing.kv_events import END_SEQ, BatchOrder, KVEventSubscriber, RankMirror, Verdict
from tests.helpers.wait import wait_until
from tokenization.block_hash import BlockHasher

BLOCK = 16


def test_batches_a_replay_applied_and_the_sub_queued_are_copies_not_a_restart() -> None:
    order = BatchOrder()
    # The SUB connected, then the replay applied 0..10; the SUB queued 7..10 meanwhile.
    order.applied_through(10)
    assert [order.received_live(seq) for seq in (7, 8, 9, 10)] == [Verdict.COPY] * 4
    assert order.received_live(11) is Verdict.NEXT
    order.applied_through(11)
    assert order.applied == 11


def test_a_gap_and_a_restart() -> None:
    order = BatchOrder()
    assert order.received_live(0) is Verdict.NEXT
    order.applied_through(0)
    assert order.received_live(3) is Verdict.GAP  # 1 and 2 were missed
    order.applied_through(3)
    # The rank restarted: its publisher numbers from 0 again, below what the SUB received.
    assert order.received_live(0) is Verdict.RESTART
    assert order.applied == -1
    order.applied_through(0)
    assert order.received_live(1) is Verdict.NEXT
    # A restart the SUB joins late is a restart, then a gap from the new publisher's first batch.
    order.applied_through(1)
    assert order.received_live(1) is Verdict.RESTART
    assert order.applied == -1


def _batch(tokens: list[int], u64: int) -> bytes:
    event = {"type": "BlockStored", "block_hashes": [u64], "parent_block_hash": None}
    event |= {"token_ids": tokens, "block_size": BLOCK}
    return msgspec.msgpack.encode([1.0, [event], 0])


def test_a_batch_that_cannot_be_applied_does_not_end_the_feed() -> None:
    """A subscriber thread that died on one bad batch would leave the rank's mirror frozen for good."""
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    hasher = BlockHasher(BLOCK, "sha256", seed="0")
    index = MemoryPrefixIndex()
    faults: list[tuple[str, int]] = []
    subscriber = KVEventSubscriber(
        RankMirror("r0", index, hasher),
        f"tcp://127.0.0.1:{port}",
        zmq_context=context,
        on_fault=lambda kind, count: faults.append((kind, count)),
    ).start()
    try:
        first, second = list(range(BLOCK)), list(range(100, 100 + BLOCK))

        seq = -1

        def send(payload: bytes) -> None:
            nonlocal seq
            seq += 1
            publisher.send_multipart([b"", seq.to_bytes(8, "big"), payload])

        # A SUB receives only once its subscription reached the publisher: send until one arrived
        # (the batches it missed are a gap; without a replay socket they are logged as lost).
        def first_applied() -> bool:
            send(_batch(first, 1))
            return subscriber.batches >= 1

        wait_until(first_applied, lambda: "no batch arrived", 5.0, interval=0.02)
        wait_until(lambda: subscriber.last_seq == seq, lambda: f"applied through {subscriber.last_seq}", 5.0)
        assert index.match(hasher.hash_blocks(first)) == {"r0": 1}
        send(b"\xc1 not msgpack")
        send(_batch(second, 2))
        wait_until(lambda: subscriber.last_seq == seq, lambda: f"applied through {subscriber.last_seq}", 5.0)
        assert subscriber.errors == 1 and subscriber.restarts == 0
        assert ("error", 1) in faults and not [f for f in faults if f[0] == "restart"]
        # The bad batch cleared the mirror (it may have been half applied); the next one refilled it.
        assert index.match(hasher.hash_blocks(first)) == {}
        assert index.match(hasher.hash_blocks(second)) == {"r0": 1}
        # A block stored on a chain this feed never saw cannot be keyed: counted, not mirrored.
        orphan = {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": 99}
        orphan |= {"token_ids": list(range(200, 200 + BLOCK)), "block_size": BLOCK}
        send(msgspec.msgpack.encode([1.0, [orphan], 0]))
        wait_until(lambda: subscriber.last_seq == seq, lambda: f"applied through {subscriber.last_seq}", 5.0)
        assert faults[-1] == ("unmapped", 1)
    finally:
        subscriber.stop()
        publisher.close(0)
        context.term()


def test_a_replay_the_rank_dropped_batches_of_is_asked_again_from_the_hole() -> None:
    """vLLM's replay ROUTER drops what exceeds its send queue, silently: applying the batches after
    a hole would leave the dropped ones out of the mirror for good."""
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    pub_port = publisher.bind_to_random_port("tcp://127.0.0.1")
    router = context.socket(zmq.ROUTER)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    batches = [_batch(list(range(k * BLOCK, (k + 1) * BLOCK)), k) for k in range(10)]
    asked: list[int] = []

    def serve() -> None:
        for dropped in ({5, 6}, set()):  # the first answer loses 5 and 6; the second is whole
            if not router.poll(5000):
                return
            identity, _, start = router.recv_multipart()
            asked.append(int.from_bytes(start, "big"))
            for seq in range(asked[-1], len(batches)):
                if seq not in dropped:
                    router.send_multipart([identity, b"", b"kv", seq.to_bytes(8, "big"), batches[seq]])
            router.send_multipart([identity, b"", b"kv", END_SEQ, b""])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    hasher = BlockHasher(BLOCK, "sha256", seed="0")
    index = MemoryPrefixIndex()
    subscriber = KVEventSubscriber(
        RankMirror("r0", index, hasher),
        f"tcp://127.0.0.1:{pub_port}",
        f"tcp://127.0.0.1:{replay_port}",
        zmq_context=context,
    )
    try:
        subscriber.start(wait_s=5.0)
        assert subscriber.connected.is_set()
        server.join(5)
        assert asked == [0, 5]
        assert subscriber.last_seq == 9 and subscriber.replayed == 10
        assert subscriber.faults["replay_drop"] == 1
        for k in range(10):
            assert index.match(hasher.hash_blocks(list(range(k * BLOCK, (k + 1) * BLOCK)))) == {"r0": 1}, k
    finally:
        subscriber.stop()
        for socket in (publisher, router):
            socket.close(0)
        context.term()
