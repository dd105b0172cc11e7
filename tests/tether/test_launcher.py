"""`tether serve` end to end: the real daemon and proxy under the launcher."""

from __future__ import annotations

import errno
import functools
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.wait import free_port, wait_for
from tests.tether.helpers import child_env

READY_TIMEOUT_S = 180.0
DRAIN_S = 2.0


class Serve:
    def __init__(self, tmp_path: Path, port: int) -> None:
        self.tmp = tmp_path
        self.port = port
        self.run_dir = tmp_path / "run"
        self.log_path = tmp_path / "serve.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tether.cli", "serve", "--runtime-dir", str(self.run_dir),
                 "--state-dir", str(tmp_path / "state"), "--port", str(port),
                 "--log-format", "json", "--drain-timeout-s", str(DRAIN_S)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, f"tether serve exited early:\n{self.log()}"
            return "tether: ready at" in self.log()
        wait_for(ready, READY_TIMEOUT_S, "the ready line")

    def children(self) -> dict[str, psutil.Process]:
        out = {}
        for child in psutil.Process(self.proc.pid).children():
            try:
                cmdline = child.cmdline()
            except psutil.Error:  # exited, not reaped yet
                continue
            if cmdline[-1:] in (["daemon"], ["proxy"]):
                out[cmdline[-1]] = child
        return out

    def health(self) -> int:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2.0).status_code
        except httpx.HTTPError:
            return 0


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    server = Serve(tmp_path, free_port())
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()
    print(server.log()[-6000:])


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _assert_fifos_unused(run_dir: Path) -> None:
    for name in ("requests", "control", "tokens"):
        path = run_dir / name
        with pytest.raises(OSError) as no_reader:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        assert no_reader.value.errno == errno.ENXIO, f"{path} still has a reader"
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            assert os.read(fd, 1) == b"", f"{path} still has a writer"
        except BlockingIOError:
            raise AssertionError(f"{path} still has a writer") from None
        finally:
            os.close(fd)


def test_serve_restarts_a_killed_daemon_and_stops_cleanly(serve: Serve) -> None:
    serve.wait_ready()
    assert "FIFOs" in serve.log() and str(serve.run_dir / "requests") in serve.log()
    assert f"curl -N http://127.0.0.1:{serve.port}/v1/completions" in serve.log()
    wait_for(lambda: serve.health() == 200, 30.0, "/health 200")
    first = serve.children()
    assert set(first) == {"daemon", "proxy"}

    first["daemon"].send_signal(signal.SIGKILL)
    wait_for(lambda: serve.children().get("daemon", first["daemon"]).pid != first["daemon"].pid,
             30.0, "a new daemon process")
    wait_for(lambda: serve.health() == 200, READY_TIMEOUT_S, "/health 200 after the restart")
    second = serve.children()
    assert second["proxy"].pid == first["proxy"].pid, "the proxy must ride out a daemon crash"
    assert "daemon was killed by SIGKILL; restarting" in serve.log()

    serve.proc.send_signal(signal.SIGTERM)
    assert serve.proc.wait(DRAIN_S + 30) == 0
    for proc in (*first.values(), *second.values()):
        assert _gone(proc), f"{proc.pid} outlived tether serve"
    _assert_fifos_unused(serve.run_dir)


def test_children_do_not_outlive_a_killed_launcher(serve: Serve) -> None:
    serve.wait_ready()
    children = list(serve.children().values())
    assert len(children) == 2
    serve.proc.kill()  # no chance to clean up: PR_SET_PDEATHSIG has to do it
    serve.proc.wait()
    for proc in children:
        wait_for(functools.partial(_gone, proc), DRAIN_S + 30, f"pid {proc.pid} to exit")
    _assert_fifos_unused(serve.run_dir)


def test_serve_fails_fast_when_a_child_cannot_start(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = Serve(tmp_path, taken.getsockname()[1])
        try:
            assert server.proc.wait(120) == 1, server.log()
        finally:
            if server.proc.poll() is None:
                server.proc.kill()
    assert "proxy exited with status" in server.log() and "before it was ready" in server.log()
    assert "tether: ready at" not in server.log()
    _assert_fifos_unused(tmp_path / "run")
