"""Each thread that encodes gets an ``Encoding`` of its own, up to a limit
(``tokenization.tiktoken_tokenizer``): tiktoken is slower on an ``Encoding`` another thread used
first (``bench.proxy_cpu``'s first turns measured what that costs: docs/investigations.md)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import tiktoken

from tokenization.block_hash import make_hasher
from tokenization.prompt import IncrementalTokenizer
from tokenization.tiktoken_tokenizer import (
    THREAD_ENCODINGS,
    TiktokenTokenizer,
    _ThreadEncodings,
    chatml_encoding,
    thread_encoding,
)

TEXT = "def main():\n    return 'héllo <|im_start|> wörld' * 3  # 12345\n"


def in_threads(encodings: _ThreadEncodings, count: int) -> list[tuple[tiktoken.Encoding, tiktoken.Encoding]]:
    """What ``count`` threads get, one after the other, asking twice each."""
    got: list[tuple[tiktoken.Encoding, tiktoken.Encoding]] = []
    for _ in range(count):
        thread = threading.Thread(target=lambda: got.append((encodings.get(), encodings.get())))
        thread.start()
        thread.join()
    return got


def test_the_first_thread_shares_then_each_gets_its_own_up_to_the_limit() -> None:
    encodings = _ThreadEncodings(limit=2)
    got = in_threads(encodings, 5)
    shared = chatml_encoding()
    assert all(first is second for first, second in got)  # a thread keeps its encoding
    firsts = [first for first, _ in got]
    assert firsts[0] is shared  # the first to ask uses the shared one
    assert firsts[1] is not shared and firsts[2] is not shared and firsts[1] is not firsts[2]
    assert firsts[3] is shared and firsts[4] is shared  # past the limit: the shared one
    special = {"allowed_special": "all", "disallowed_special": ()}
    want = shared.encode(TEXT, **special)
    assert all(e.encode(TEXT, **special) == want for e in firsts)
    assert firsts[1].special_tokens_set == shared.special_tokens_set


def test_the_module_hands_the_calling_thread_the_same_encoding_each_time() -> None:
    assert THREAD_ENCODINGS >= 1
    mine = thread_encoding()
    assert thread_encoding() is mine
    other: list[tiktoken.Encoding] = []
    thread = threading.Thread(target=lambda: other.append(thread_encoding()))
    thread.start()
    thread.join()
    assert other[0].encode(TEXT, allowed_special="all") == mine.encode(TEXT, allowed_special="all")


class ThreadsPrepared(TiktokenTokenizer):
    """Tiktoken noting the threads it prepared, and the encoding each was left with."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: dict[int, tiktoken.Encoding] = {}
        self.order: list[int] = []

    def prepare_thread(self) -> None:
        super().prepare_thread()
        self.order.append(threading.get_ident())
        self.prepared[threading.get_ident()] = thread_encoding()


def on_each_thread(pool: ThreadPoolExecutor, threads: int) -> dict[int, tiktoken.Encoding]:
    """The encoding each of the pool's ``threads`` threads encodes with (one task per thread)."""
    barrier = threading.Barrier(threads)

    def encoding() -> tuple[int, tiktoken.Encoding]:
        barrier.wait(timeout=10)
        return threading.get_ident(), thread_encoding()

    return dict(future.result() for future in [pool.submit(encoding) for _ in range(threads)])


async def test_the_loop_and_every_worker_thread_are_prepared_before_the_first_turn() -> None:
    """``prefixgate serve`` builds each thread's encoding at start: on a first burst, each of the
    pool's threads built its own inside a first turn (~50 ms of CPU each)."""
    tokenizer = ThreadsPrepared()
    with ThreadPoolExecutor(3) as pool:
        incremental = IncrementalTokenizer(tokenizer, make_hasher("xxh3", 16, "0"), executor=pool)
        await incremental.prepare_threads(3)
        later = on_each_thread(pool, 3)
    assert tokenizer.order[0] == threading.get_ident()  # the loop's thread first
    assert len(tokenizer.order) == 4 and set(tokenizer.order[1:]) == set(later)  # 3 threads, each once
    assert all(tokenizer.prepared[thread] is encoding for thread, encoding in later.items())
