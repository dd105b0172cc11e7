import pytest
from hypothesis import given
from hypothesis import strategies as st

from ipc.framing import (
    FrameTooLarge,
    daemon_decoder,
    encode,
    encode_control,
    encode_many,
    proxy_decoder,
)
from ipc.records import Abort, AbortCause, Delta, Finish, FinishReason, Usage


@given(st.lists(st.tuples(st.text(), st.integers(0, 64), st.text()), max_size=20))
def test_records_roundtrip_through_any_chunking(items: list[tuple[str, int, str]]) -> None:
    records = [Delta(rid, i, text, [i]) for rid, i, text in items]
    data = b"".join(encode(r) for r in records)
    decoder = proxy_decoder()
    out = []
    for cut in range(0, len(data), 7):
        out.extend(decoder.feed(data[cut : cut + 7]))
    assert out == records
    assert decoder.num_bad == 0


def test_corrupt_frame_is_counted_and_neighbours_survive() -> None:
    good = Finish("r", 0, FinishReason.STOP, Usage(1, 2))
    data = encode(good) + b"{not json\n" + b'{"k":"unknown"}\n' + encode(good)
    decoder = proxy_decoder()
    assert list(decoder.feed(data)) == [good, good]
    assert decoder.num_bad == 2


def test_oversized_frame_is_skipped() -> None:
    abort = Abort("r", AbortCause.CLIENT_DISCONNECT, 1, 2.0)
    decoder = daemon_decoder("control")
    decoder.max_frame = 150
    data = b"x" * 400 + b"\n" + encode_control(abort)
    assert list(decoder.feed(data[:200])) == []
    assert list(decoder.feed(data[200:])) == [abort]
    assert decoder.num_bad == 1


def test_feed_consumes_its_bytes_even_if_the_caller_stops_early() -> None:
    records = [Delta("r", i, "t", [i]) for i in range(3)]
    data = b"".join(encode(r) for r in records)
    decoder = proxy_decoder()
    first = decoder.feed(data[:-5])
    for _ in first:
        break  # a consumer that stops (or raises) after one record
    assert first == records[:2]
    assert decoder.feed(data[-5:]) == records[2:]


def test_large_frame_arriving_in_small_pieces() -> None:
    big = Delta("r", 0, "x" * 300_000, list(range(1000)))
    data = encode(big) + encode(big)
    decoder = proxy_decoder()
    out = []
    for cut in range(0, len(data), 1000):
        out.extend(decoder.feed(data[cut : cut + 1000]))
    assert out == [big, big]
    assert decoder.num_bad == 0


def test_encode_many_equals_joined_encode() -> None:
    records = [Delta("r", i, "t\n\u2028", [i]) for i in range(5)]
    assert encode_many(records) == b"".join(encode(r) for r in records)
    assert encode_many([]) == b""
    with pytest.raises(FrameTooLarge, match="Delta frame is"):
        encode_many([*records, Delta("r", 9, "x" * 500, [])], limit=200)
