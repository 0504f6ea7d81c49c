"""The Redis index's block keys: each digest's last 8 bytes, whatever the hasher's width."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.state.redis.index import _keys_blob


def reference(block_hashes: list[bytes]) -> bytes:
    return b"".join(h[-8:] for h in block_hashes)


@given(
    st.sampled_from([8, 16, 32]).flatmap(lambda w: st.lists(st.binary(min_size=w, max_size=w), max_size=64))
)
def test_a_chain_of_one_width_gives_each_digests_last_8_bytes(block_hashes: list[bytes]) -> None:
    assert _keys_blob(block_hashes) == reference(block_hashes)


@given(st.lists(st.binary(min_size=8, max_size=40), min_size=1, max_size=16))
def test_digests_of_other_widths_give_their_last_8_bytes_too(block_hashes: list[bytes]) -> None:
    first = len(block_hashes[0])
    mixed = any(len(h) != first for h in block_hashes)
    if mixed and first % 8 == 0 and sum(map(len, block_hashes)) == first * len(block_hashes):
        return  # mixed widths that add up as one width: no hasher makes such a chain (see _keys_blob)
    assert _keys_blob(block_hashes) == reference(block_hashes)
