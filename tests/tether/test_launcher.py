"""`tether serve` end to end: the real daemon and proxy under the launcher."""

from __future__ import annotations

import errno
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from ipc.dir_lock import Role, lock_path
from tests.support.pair import start_server
from tests.support.raw_http import post_raw, read_events
from tests.support.serve import DRAIN_S, READY_TIMEOUT_S, Serve, gone
from tests.support.systemd import child_env
from tests.support.wait import free_port, wait_for


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    server = Serve(tmp_path, free_port())
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()
    print(server.log()[-6000:])


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
        assert gone(proc), f"{proc.pid} outlived tether serve"
    _assert_fifos_unused(serve.run_dir)


def test_serve_restarts_a_daemon_that_stops_on_its_own(serve: Serve) -> None:
    """SIGTERM to the daemon alone: it drains and exits 0, but nobody asked the launcher to
    stop, so the daemon comes back and the proxy answers again."""
    serve.wait_ready()
    wait_for(lambda: serve.health() == 200, 30.0, "/health 200")
    first = serve.children()["daemon"]
    first.send_signal(signal.SIGTERM)
    wait_for(lambda: serve.children().get("daemon", first).pid != first.pid, DRAIN_S + 30,
             lambda: f"a new daemon process\n{serve.log()[-3000:]}")
    wait_for(lambda: serve.health() == 200, READY_TIMEOUT_S, "/health 200 after the restart")
    assert "daemon exited with status 0; restarting" in serve.log(), serve.log()[-3000:]


def test_children_do_not_outlive_a_killed_launcher(serve: Serve) -> None:
    serve.wait_ready()
    children = list(serve.children().values())
    assert len(children) == 2
    serve.proc.kill()  # no chance to clean up: PR_SET_PDEATHSIG has to do it
    serve.proc.wait()
    for proc in children:
        wait_for(functools.partial(gone, proc), DRAIN_S + 30, f"pid {proc.pid} to exit")
    _assert_fifos_unused(serve.run_dir)


def _cpu_until_exit(proc: psutil.Process) -> float:
    """CPU seconds (user + system) the process itself spends from now until it exits."""
    start = last = proc.cpu_times()
    while True:
        try:
            last = proc.cpu_times()
            if proc.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    return (last.user + last.system) - (start.user + start.system)


def test_stopping_with_streams_in_flight_costs_next_to_no_cpu(tmp_path: Path) -> None:
    """While the children drain, their notifications keep arriving: the launcher must read them
    (not spin on a readable socket), and a full queue must never freeze a child's loop."""
    drain_s = 6.0
    serve = Serve(tmp_path, free_port(), drain_s=drain_s)
    streams = []
    try:
        serve.wait_ready()
        wait_for(lambda: serve.health() == 200, 30.0, "/health 200")
        body = {"prompt": "x", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
        body["max_tokens"] = httpx.get(f"http://127.0.0.1:{serve.port}/v1/models").json()[
            "data"][0]["max_model_len"] - 8
        streams = [post_raw(serve.port, "/v1/completions", body) for _ in range(3)]
        for sock in streams:
            read_events(sock, 1)
        launcher = psutil.Process(serve.proc.pid)
        serve.proc.send_signal(signal.SIGTERM)
        cpu = _cpu_until_exit(launcher)
        assert serve.proc.wait(drain_s + 30) == 0
    finally:
        for sock in streams:
            sock.close()
        if serve.proc.poll() is None:
            serve.proc.kill()
            serve.proc.wait()
    print(f"launcher CPU while stopping: {cpu:.3f} s")
    assert "did not stop in time" not in serve.log(), serve.log()[-3000:]
    assert cpu < 1.0, f"the launcher spent {cpu:.2f} s of CPU stopping"


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


def _complete(port: int, model: str | None = None) -> httpx.Response:
    body = {"prompt": "hi", "max_tokens": 2, **({"model": model} if model else {})}
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60.0)


def test_a_request_sent_the_moment_ready_is_printed_is_served(tmp_path: Path) -> None:
    """Ready means a request sent then is served: five starts in a row on one directory, each
    sending a request the instant the line is read. sim:5 loads in no time, which leaves the
    proxy the least time to connect before the daemon says READY=1."""
    command = [sys.executable, "-m", "tether.cli", "serve", "--runtime-dir", str(tmp_path / "run"),
               "--state-dir", str(tmp_path / "state"), "--model", "sim:5",
               "--served-model-name", "team/demo", "--log-format", "json"]
    for attempt in range(5):
        port = free_port()
        with open(tmp_path / "serve.log", "ab") as log:
            proc = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.PIPE,
                                    stderr=log, stdin=subprocess.DEVNULL, env=child_env())
        try:
            assert proc.stdout is not None
            line = b""
            while b"tether: ready at" not in line:
                line = proc.stdout.readline()
                assert line, f"tether serve exited {proc.wait()}"
            answer = _complete(port, "team/demo")
            assert answer.status_code == 200, (attempt, answer.text)
            # The curl line names the model as clients must send it.
            assert '"model": "team/demo"' in proc.stdout.readline().decode()
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(DRAIN_S + 30) == 0


def test_ctrl_c_stops_the_pair_without_a_warning(serve: Serve) -> None:
    serve.wait_ready()
    assert _complete(serve.port).status_code == 200
    serve.proc.send_signal(signal.SIGINT)
    assert serve.proc.wait(DRAIN_S + 30) == 0
    lines = serve.log().splitlines()
    logged = [json.loads(line) for line in lines if line.startswith("{")]
    assert {line["component"] for line in logged} >= {"serve", "daemon", "proxy"}
    loud = [line for line in logged if line["level"] not in ("debug", "info")]
    assert not loud, loud
    # Python's own warnings (torch's) bypass the JSON log: only the launcher's lines remain.
    others = [line for line in lines if not line.startswith(("{", "tether: ", "  curl "))]
    assert not others, others


def test_a_second_pair_on_the_directory_is_refused_and_the_first_keeps_serving(
        serve: Serve, tmp_path: Path) -> None:
    serve.wait_ready()
    first = serve.children()
    for command, holder in (("serve", "daemon"), ("daemon", "daemon"), ("proxy", "proxy")):
        other = subprocess.Popen(
            [sys.executable, "-m", "tether.cli", command, "--runtime-dir", str(serve.run_dir),
             "--state-dir", str(tmp_path / "other"), "--port", str(free_port()),
             "--model", "sim:5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=child_env())
        try:
            said = other.communicate(timeout=60)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            other.kill()
            raise AssertionError(f"a second `tether {command}` was not refused: "
                                 f"{other.communicate()[0].decode(errors='replace')}") from None
        assert other.returncode != 0, said
        assert (f"runtime directory {serve.run_dir} is in use by another tether {holder} "
                f"(pid {first[holder].pid})") in said and "--runtime-dir" in said, said
    assert {n: p.pid for n, p in serve.children().items()} == {
        n: p.pid for n, p in first.items()}
    assert serve.health() == 200 and _complete(serve.port).status_code == 200
    assert "daemon lost" not in serve.log() and "proxy lost" not in serve.log()


def test_a_pair_killed_with_sigkill_leaves_a_lock_the_next_pair_takes_over(
        tmp_path: Path) -> None:
    bare = start_server(tmp_path, ["--model", "sim:5"])  # as the systemd units run them
    try:
        assert bare.daemon is not None and bare.proxy is not None
        held = {Role.DAEMON: bare.daemon.pid, Role.PROXY: bare.proxy.pid}
        bare.kill("daemon")
        bare.kill("proxy")
    finally:
        bare.stop()
    run = tmp_path / "run"
    assert {role: lock_path(run, role).read_text() for role in Role} == {
        role: f"{pid}\n" for role, pid in held.items()}
    serve = Serve(tmp_path, free_port(), extra=["--model", "sim:5"])
    try:
        serve.wait_ready()
        assert _complete(serve.port).status_code == 200
        children = serve.children()
        assert {role: lock_path(run, role).read_text() for role in Role} == {
            role: f"{children[role.value].pid}\n" for role in Role}
    finally:
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(DRAIN_S + 30) == 0
