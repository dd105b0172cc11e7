"""Random and ill-typed frames written into the real FIFOs of a real pair — the daemon's control
and requests pipes, the proxy's tokens pipe — while a stream runs: each is counted in
``tether_ipc_bad_records_total{pipe}`` and skipped, and nothing else notices (the stream
completes token for token, neither process restarts, /health stays 200).

A frame is one write of at most PIPE_BUF bytes ending in a newline, so the kernel never
interleaves it with the real writer's frames: what is under test is the readers' handling of
bad frames, not a torn write.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Iterator

import msgspec
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipc.records import PIPE_BUF
from ipc.wire import ToDaemon, ToProxy
from tests.support.metrics import m
from tests.support.pair import Server, post_raw, start_server
from tests.support.raw_http import read_events, read_to_end, sse_json
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(300)

FRAMES_PER_PIPE = 30
STREAM_TOKENS = 1500
_DECODERS = {"control": msgspec.json.Decoder(ToDaemon), "requests": msgspec.json.Decoder(ToDaemon),
             "tokens": msgspec.json.Decoder(ToProxy)}
# A value no field of any record accepts where it is required (string, number, enum, struct).
_WRONG = [[[]], {"\x00": [None]}, [True, "x"], -1.5e308]


def _kinds(union: object) -> list[tuple[str, list[str]]]:
    """(tag, required field names) of every record in a union."""
    out = []
    for record in typing.get_args(union):
        info = msgspec.inspect.type_info(record)
        out.append((str(info.tag), [f.encode_name for f in info.fields if f.required]))
    return out


@st.composite
def ill_typed(draw: st.DrawFn, union: object) -> bytes:
    """A record of a real kind with one required field of the wrong type, or missing."""
    tag, required = draw(st.sampled_from(_kinds(union)))
    record: dict[str, object] = {"k": tag}
    for name in required:
        record[name] = draw(st.sampled_from(["x", 1, 0.5, {"a": 1}, ["x"]]))
    victim = draw(st.sampled_from(required))
    if draw(st.booleans()):
        del record[victim]
    else:
        record[victim] = draw(st.sampled_from(_WRONG))
    return orjson.dumps(record)


def frames(pipe: str) -> st.SearchStrategy[bytes]:
    union = ToProxy if pipe == "tokens" else ToDaemon
    other = ToDaemon if pipe == "tokens" else ToProxy
    junk = st.one_of(
        st.binary(min_size=1, max_size=2000),  # not JSON at all
        st.builds(orjson.dumps, st.recursive(
            st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20),
            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                st.text(max_size=5), inner, max_size=4), max_leaves=20)),
        st.builds(lambda k: orjson.dumps({"k": k, "rid": "x"}), st.text(max_size=10)),
        ill_typed(union),
        ill_typed(other),  # a record of the other direction: no such kind on this pipe
    )
    return junk.map(lambda b: b.replace(b"\n", b" ")[: PIPE_BUF - 1].strip() or b"?").filter(
        lambda b: _undecodable(pipe, b))


def _undecodable(pipe: str, frame: bytes) -> bool:
    try:
        _DECODERS[pipe].decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return True
    return False


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("pipes"), ["--max-num-seqs", "8"])
    yield s
    s.stop()


def _bad(server: Server) -> dict[str, float]:
    figures = server.metrics()
    return {pipe: m(figures, "tether_ipc_bad_records_total", pipe=pipe)
            for pipe in _DECODERS}


def test_bad_frames_on_every_pipe_are_counted_and_skipped(server: Server) -> None:
    assert server.daemon is not None and server.proxy is not None
    pids = (server.daemon.pid, server.proxy.pid)
    body = {"prompt": "x", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    stream = post_raw(server, "/v1/completions", body)
    head = read_events(stream, 1)
    fds = {pipe: os.open(server.tmp / "run" / pipe, os.O_WRONLY | os.O_NONBLOCK)
           for pipe in _DECODERS}
    try:
        @settings(max_examples=3, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(batch=st.fixed_dictionaries({pipe: st.lists(frames(pipe), min_size=1,
                                                            max_size=FRAMES_PER_PIPE)
                                            for pipe in _DECODERS}))
        def write_batch(batch: dict[str, list[bytes]]) -> None:
            before = _bad(server)
            for pipe, batch_frames in batch.items():
                for frame in batch_frames:
                    assert os.write(fds[pipe], frame + b"\n") == len(frame) + 1
            expected = {pipe: before[pipe] + len(batch[pipe]) for pipe in batch}
            wait_for(lambda: _bad(server) == expected, 30,
                     f"bad-record counts {expected} (now {_bad(server)})")
            assert server.health() == 200

        write_batch()
    finally:
        for fd in fds.values():
            os.close(fd)
    raw = (head + read_to_end(stream)).decode()
    stream.close()
    events = [e for e in map(sse_json, raw.replace("\r\n", "\n").split("\n")) if e is not None]
    token_ids = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert len(token_ids) == STREAM_TOKENS, raw[-500:]
    assert events[-1]["usage"]["completion_tokens"] == STREAM_TOKENS
    assert "data: [DONE]" in raw and '"error"' not in raw
    assert (server.daemon.pid, server.proxy.pid) == pids
    assert server.daemon.poll() is None and server.proxy.poll() is None
