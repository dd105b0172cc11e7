"""DaemonConnection on real FIFOs, the test playing the proxy with raw write ends: what the tick
loop reads from it, in order."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipc.framing import encode, encode_control
from ipc.pipes import (
    Connected,
    DaemonConnection,
    DaemonPipes,
    Loss,
    LossReason,
    Lost,
    ModelInfo,
    Stale,
)
from ipc.reasons import Reason
from ipc.records import (
    PROTOCOL_VERSION,
    Abort,
    AbortCause,
    Error,
    Goodbye,
    Heartbeat,
    Hello,
    RequestKind,
    SamplingParams,
    Submit,
    Welcome,
)

MODEL = ModelInfo("m", 64, 2)


class RawProxy:
    def __init__(self, run: Path) -> None:
        self.run = run
        self.open()

    def open(self) -> None:
        self.control = os.open(self.run / "control", os.O_WRONLY | os.O_NONBLOCK)
        self.requests = os.open(self.run / "requests", os.O_WRONLY | os.O_NONBLOCK)

    def send(self, *records: object) -> None:
        for rec in records:
            if isinstance(rec, Submit):
                os.write(self.requests, encode(rec))
            else:
                os.write(self.control, encode_control(rec))  # type: ignore[arg-type]

    def close(self) -> None:
        os.close(self.control)
        os.close(self.requests)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[DaemonConnection, RawProxy]]:
    pipes = DaemonPipes(tmp_path)
    proxy = RawProxy(tmp_path)
    yield DaemonConnection(pipes, MODEL), proxy
    proxy.close()
    pipes.close()


def welcome(epoch: int, nonce: int) -> Welcome:
    return Welcome(PROTOCOL_VERSION, os.getpid(), "m", 64, epoch, nonce, 2)


def submit(rid: str, epoch: int) -> Submit:
    return Submit(rid, RequestKind.COMPLETION, SamplingParams(), prompts=["x"], epoch=epoch)


def test_a_hello_opens_an_epoch_and_its_repeats_keep_it(pair) -> None:
    conn, proxy = pair
    proxy.send(Hello(PROTOCOL_VERSION, 1, 3, nonce=9))
    assert conn.read_control() == [Connected(3), welcome(3, 9)]  # the proposal is a floor
    proxy.send(Hello(PROTOCOL_VERSION, 1, 3, nonce=9), Heartbeat(3, 0.0))
    assert conn.read_control() == [welcome(3, 9)]
    proxy.send(Hello(PROTOCOL_VERSION, 1, 1, nonce=10))  # a new connection: above every other
    assert conn.read_control() == [Connected(4), welcome(4, 10)]


def test_only_submits_of_the_current_epoch_are_work(pair) -> None:
    conn, proxy = pair
    proxy.send(Hello(PROTOCOL_VERSION, 1, 1, nonce=1))
    assert conn.read_control()[0] == Connected(1)
    proxy.send(submit("a", 1), submit("b", 0))
    assert conn.read_requests() == [submit("a", 1), Stale(submit("b", 0))]
    abort = Abort("a", AbortCause.CANCEL, 1)
    proxy.send(Goodbye(0), abort)  # a goodbye of another epoch changes nothing
    assert conn.read_control() == [abort]
    proxy.send(Goodbye(1), submit("late", 1))
    assert conn.read_control() == [Goodbye(1)]
    assert conn.read_requests() == [Stale(submit("late", 1))]


def test_a_loss_ends_the_epoch_and_is_told_before_the_next_connection(pair) -> None:
    conn, proxy = pair
    proxy.send(Hello(PROTOCOL_VERSION, 1, 1, nonce=1))
    assert conn.read_control()[0] == Connected(1)
    proxy.close()
    assert conn.read_requests() == []  # EOF: the loss is the connection's news, not the read's
    proxy.open()
    proxy.send(Hello(PROTOCOL_VERSION, 2, 1, nonce=2), submit("old", 1))
    lost = Lost(Loss(LossReason.EOF, "proxy closed the requests pipe (EOF)"))
    assert conn.read_control() == [lost, Connected(2), welcome(2, 2)]
    assert conn.read_requests() == [Stale(submit("old", 1))]
    abort = Abort("a", AbortCause.CANCEL, 2)
    proxy.send(abort)
    proxy.close()  # a loss a read of control notices comes after the records it read
    eof = Loss(LossReason.EOF, "proxy closed the control pipe (EOF)")
    assert conn.read_control() == [abort, Lost(eof)]
    proxy.open()


def test_another_protocol_version_is_refused_by_its_code(pair) -> None:
    conn, proxy = pair
    proxy.send(Hello(PROTOCOL_VERSION + 1, 1, 1, nonce=5))
    [refusal] = conn.read_control()
    assert isinstance(refusal, Error) and refusal.rid is None
    assert refusal.reason is Reason.VERSION_MISMATCH
    assert f"proxy {PROTOCOL_VERSION + 1}" in refusal.message
    proxy.send(submit("a", 1))
    assert conn.read_requests() == [Stale(submit("a", 1))]  # no epoch was opened


def test_a_goodbye_still_in_control_at_the_requests_eof_makes_it_a_close(pair) -> None:
    """A stopping proxy writes its Goodbye, then closes both pipes; the tick may read requests'
    EOF before control: the Goodbye is read ahead, so the close is no loss."""
    conn, proxy = pair
    proxy.send(Hello(PROTOCOL_VERSION, 1, 1, nonce=1))
    assert conn.read_control()[0] == Connected(1)
    proxy.send(Goodbye(1))
    proxy.close()
    assert conn.read_requests() == []
    assert conn.read_control() == [Goodbye(1)]  # handed on, and no Lost
    proxy.open()
    proxy.send(Hello(PROTOCOL_VERSION, 2, 1, nonce=2))
    assert conn.read_control() == [Connected(2), welcome(2, 2)]
