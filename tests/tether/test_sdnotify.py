from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support.systemd import child_env
from tether import sdnotify
from tether.sdnotify import NotifyListener, notify, parse, watchdog_interval


def _receiver(address: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5.0)
    return sock


def test_notify_without_socket_returns_false(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False


def test_notify_sends_one_datagram_to_a_path_socket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify"
    with _receiver(str(path)) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert notify("READY=1\nSTATUS=loading model") is True
        assert sock.recv(4096) == b"READY=1\nSTATUS=loading model"


def test_notify_maps_a_leading_at_to_the_abstract_namespace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"tether-test-{secrets.token_hex(6)}"
    with _receiver(b"\0" + name.encode()) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("WATCHDOG=1") is True
        assert sock.recv(4096) == b"WATCHDOG=1"


def test_notify_to_a_missing_socket_returns_false(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert notify("READY=1") is False


def test_notify_ignores_addresses_it_does_not_speak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert notify("READY=1") is False


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, None),
    ({"WATCHDOG_USEC": "30000000"}, 15.0),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}, 1.0),
    ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
])
def test_watchdog_interval_is_half_the_period_for_this_process(
        environ: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval(environ) == expected


def test_parse_splits_lines_into_fields() -> None:
    assert parse(b"READY=1\nSTATUS=a=b c\n\ngarbage") == {"READY": "1", "STATUS": "a=b c"}


@pytest.mark.parametrize("kind", ["abstract", "path"])
def test_listener_attributes_each_notification_to_its_sender(tmp_path: Path, kind: str) -> None:
    listener = NotifyListener(tmp_path / "notify" if kind == "path" else None)
    try:
        assert listener.name.startswith("/" if kind == "path" else "@")
        code = "from tether.sdnotify import notify; assert notify('READY=1\\nSTATUS=up')"
        proc = subprocess.Popen([sys.executable, "-c", code],
                                env=child_env(NOTIFY_SOCKET=listener.name))
        assert proc.wait(30) == 0
        notes = listener.receive()
        assert [(n.pid, n.fields) for n in notes] == [(proc.pid, {"READY": "1", "STATUS": "up"})]
        assert listener.receive() == []
    finally:
        listener.close()
    assert kind == "abstract" or not (tmp_path / "notify").exists()


def test_notify_never_blocks_on_a_full_queue(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A supervisor that does not read: the sends past its queue are dropped, counted and warned
    about once, instead of blocking the caller's loop."""
    listener = NotifyListener(tmp_path / "notify")
    monkeypatch.setenv("NOTIFY_SOCKET", listener.name)
    monkeypatch.setattr(sdnotify, "dropped", sdnotify._Drops())
    results: list[bool] = []
    sender = threading.Thread(target=lambda: results.extend(
        notify(f"WATCHDOG=1\nSTATUS=ping {i}") for i in range(100)), daemon=True)
    try:
        with caplog.at_level(logging.WARNING, logger="tether.sdnotify"):
            sender.start()
            sender.join(10.0)
        assert not sender.is_alive(), "notify blocked on a full queue"
        queued = len(listener.receive())
        assert queued >= 1 and results.count(True) == queued
        assert sdnotify.dropped.count == results.count(False) == 100 - queued
        warnings = [r.getMessage() for r in caplog.records if "queue is full" in r.getMessage()]
        assert len(warnings) == 1 and "WATCHDOG=1" in warnings[0]
        assert notify("READY=1") is True  # room again once the supervisor has read
        assert [n.fields for n in listener.receive()] == [{"READY": "1"}]
    finally:
        listener.close()


def test_notify_keeps_one_socket_and_so_works_out_of_descriptors(tmp_path: Path) -> None:
    """A process with every descriptor in use (EMFILE) still pings: the socket it notifies
    through was opened once, at its first notification, and is used for every one after."""
    listener = NotifyListener(tmp_path / "notify")
    code = (
        "import os, resource\n"
        "from tether.sdnotify import notify\n"
        "assert notify('READY=1')\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "held = []\n"
        "try:\n"
        "    while True:\n"
        "        held.append(os.open('/dev/null', os.O_RDONLY))\n"
        "except OSError:\n"
        "    pass\n"
        "assert all(notify(f'WATCHDOG=1\\nSTATUS=ping {i}') for i in range(5))\n"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=child_env(NOTIFY_SOCKET=listener.name),
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        notes = listener.receive()
        assert [n.fields.get("STATUS") for n in notes] == [None] + [f"ping {i}" for i in range(5)]
    finally:
        listener.close()


def test_notify_reconnects_when_the_supervisor_binds_its_socket_anew(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify"
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    with _receiver(str(path)) as sock:
        assert notify("READY=1") is True
        assert sock.recv(4096) == b"READY=1"
    path.unlink()
    with _receiver(str(path)) as sock:  # the supervisor restarted: same name, a new socket
        assert notify("WATCHDOG=1") is True
        assert sock.recv(4096) == b"WATCHDOG=1"
    other = tmp_path / "other"
    monkeypatch.setenv("NOTIFY_SOCKET", str(other))
    with _receiver(str(other)) as sock:
        assert notify("STATUS=moved") is True
        assert sock.recv(4096) == b"STATUS=moved"
