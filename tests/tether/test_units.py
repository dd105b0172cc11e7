"""The systemd unit pair: systemd-analyze accepts it, and each ExecStart speaks sd_notify."""

from __future__ import annotations

import dataclasses
import grp
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.http.protocol import FD_RESERVE
from proxy.server import START_EXTEND_S
from tests.support.systemd import (
    INSTALLED_TETHER,
    TEST_MODEL,
    UNITS,
    child_env,
    unit_command,
    unit_environment,
    unit_settings,
    wait_notification,
)
from tests.support.wait import free_port
from tether import launcher, settings
from tether.cluster import smg_command, smg_path
from tether.sdnotify import NotifyListener
from tether.settings import Settings

DAEMON = UNITS / "tether-daemon.service"
PROXY = UNITS / "tether-proxy.service"
ROUTER = UNITS / "tether-router.service"
INSTALLED_SMG = "/usr/local/bin/smg"
READY_TIMEOUT_S = {"tether-daemon.service": 120.0, "tether-proxy.service": 60.0}


def _seconds(value: str) -> float:
    return float(value.removesuffix("s"))


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd); .ci/run installs it")
    # verify insists that ExecStart= exists: point it at this checkout.
    wrapper = tmp_path / "tether"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -m tether.cli \"$@\"\n")
    wrapper.chmod(0o755)
    smg = smg_path()
    assert smg is not None, "smg is a dev dependency"
    copies = []
    for unit in (DAEMON, PROXY, ROUTER):
        copy = tmp_path / unit.name
        copy.write_text(unit.read_text().replace(INSTALLED_TETHER, str(wrapper))
                        .replace(INSTALLED_SMG, smg))
        copies.append(str(copy))
    proc = subprocess.run([analyze, "verify", "--recursive-errors=yes", "--man=no", *copies],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_router_unit_uses_only_flags_that_smg_has() -> None:
    smg = smg_path()
    assert smg is not None, "smg is a dev dependency"
    known = set(re.findall(r"--[a-z0-9-]+", subprocess.run(
        [smg, "launch", "--help"], capture_output=True, text=True, timeout=60).stdout))
    exec_start = unit_settings(ROUTER)["ExecStart"][0]
    used = set(re.findall(r"(?<![\w$])--[a-z0-9-]+", exec_start))
    assert used and used <= known, f"flags smg does not know: {sorted(used - known)}"
    assert exec_start.split()[0] == INSTALLED_SMG
    # The same router command as `tether cluster` uses, flag for flag.
    assert used == {a for a in smg_command("smg", ["u"], "h", 1, 2) if a.startswith("--")} \
        - {"--log-level"} | {"--log-json"}


def test_proxy_survives_daemon_restarts_by_design() -> None:
    proxy = unit_settings(PROXY)
    assert "BindsTo" not in proxy and "PartOf" not in proxy and "Requires" not in proxy
    assert "tether-daemon.service" in proxy["Wants"][0]
    assert "tether-daemon.service" in proxy["After"][0]


def test_units_agree_with_each_other_and_with_the_launcher() -> None:
    daemon, proxy = unit_settings(DAEMON), unit_settings(PROXY)
    for unit in (daemon, proxy):
        assert unit["Type"] == ["notify"] and unit["NotifyAccess"] == ["main"]
        assert unit["RuntimeDirectory"] == daemon["RuntimeDirectory"]
        assert unit["RuntimeDirectoryPreserve"] == ["yes"]
        assert _seconds(unit["WatchdogSec"][0]) == launcher.WATCHDOG_S
        assert _seconds(unit["TimeoutStopSec"][0]) > Settings().drain_timeout_s
        assert unit["User"] == daemon["User"]  # both own the shared runtime directory
    assert (unit_environment(DAEMON)["TETHER_RUNTIME_DIR"]
            == "/run/" + daemon["RuntimeDirectory"][0])
    assert unit_environment(PROXY) == unit_environment(DAEMON)


def test_units_give_each_process_descriptors_for_every_connection() -> None:
    """Without LimitNOFILE= a service starts at 1024 descriptors: fewer than the proxy's
    default connection cap, which it would then lower to fit."""
    for unit in (DAEMON, PROXY):
        limit = int(unit_settings(unit)["LimitNOFILE"][0])
        assert limit >= Settings().max_connections + FD_RESERVE, unit.name


def test_example_environment_file_mentions_every_variable() -> None:
    text = (UNITS / "tether.env").read_text()
    for f in dataclasses.fields(Settings):
        assert f"#{settings.env_name(f.name)}=" in text


@pytest.fixture
def listener() -> Iterator[NotifyListener]:
    sock = NotifyListener()
    yield sock
    sock.close()


def _unit_env(unit: Path, tmp_path: Path, **more: str) -> dict[str, str]:
    """The unit's Environment=, its directories moved under `tmp_path`."""
    env = unit_environment(unit)
    env.update(TETHER_RUNTIME_DIR=str(tmp_path / "run"), TETHER_STATE_DIR=str(tmp_path / "state"),
               TETHER_PIPE_GROUP=grp.getgrgid(os.getgid()).gr_name, TETHER_LOG_FORMAT="json",
               **more)
    return env


def _start_unit(unit: Path, tmp_path: Path, listener: NotifyListener,
                port: int) -> subprocess.Popen[bytes]:
    env = _unit_env(unit, tmp_path, TETHER_PORT=str(port), NOTIFY_SOCKET=listener.name,
                    WATCHDOG_USEC="1000000")
    with open(tmp_path / f"{unit.stem}.log", "wb") as log:
        return subprocess.Popen(unit_command(unit), env=child_env(**env), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def test_daemon_exec_start_reports_ready_and_feeds_the_watchdog(
        tmp_path: Path, listener: NotifyListener) -> None:
    proc = _start_unit(DAEMON, tmp_path, listener, free_port())
    try:
        def alive() -> bool:
            return proc.poll() is None

        wait_notification(listener, proc.pid, "READY", "1", READY_TIMEOUT_S[DAEMON.name], alive)
        # WATCHDOG_USEC is 1 s: pings every 0.5 s, so two arrive well within 3 s.
        for _ in range(2):
            wait_notification(listener, proc.pid, "WATCHDOG", "1", 3.0, alive)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        _end(proc, tmp_path / f"{DAEMON.stem}.log")


def _end(proc: subprocess.Popen[bytes], log: Path) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    print(log.read_text(errors="replace")[-4000:])


def _completion(port: int) -> int:
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30.0, json={
        "model": TEST_MODEL, "prompt": "hi", "max_tokens": 1}).status_code


def test_the_unit_pair_shares_its_directory_and_the_proxy_is_ready_once_the_daemon_is(
        tmp_path: Path, listener: NotifyListener) -> None:
    """The proxy started alone binds its port, answers 503 and pings the watchdog, each ping
    extending its start, but says READY=1 only once the daemon has connected (ready means
    served). Each ExecStart holds its role's lock on the one RuntimeDirectory: the pair runs, a
    second daemon there is refused."""
    port = free_port()
    proxy = _start_unit(PROXY, tmp_path, listener, port)
    procs = [proxy]
    try:
        def alive() -> bool:
            return proxy.poll() is None

        seen = [note for _ in range(2)
                for note in wait_notification(listener, proxy.pid, "WATCHDOG", "1", 10.0, alive)]
        assert not [n for n in seen if "READY" in n.fields], seen
        assert {n.fields.get("EXTEND_TIMEOUT_USEC") for n in seen if "WATCHDOG" in n.fields} == {
            str(int(START_EXTEND_S * 1_000_000))}
        assert _completion(port) == 503  # up, and saying why it cannot serve yet
        procs.append(_start_unit(DAEMON, tmp_path, listener, port))
        wait_notification(listener, proxy.pid, "READY", "1", READY_TIMEOUT_S[DAEMON.name], alive)
        assert _completion(port) == 200
        second = subprocess.run(unit_command(DAEMON), env=child_env(**_unit_env(DAEMON, tmp_path)),
                                capture_output=True, timeout=60)
        said = (second.stdout + second.stderr).decode(errors="replace")
        assert second.returncode != 0, said
        assert f"is in use by another tether daemon (pid {procs[1].pid})" in said, said
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(30) for proc in procs] == [0, 0]
    finally:
        for proc, unit in zip(procs, (PROXY, DAEMON), strict=False):
            _end(proc, tmp_path / f"{unit.stem}.log")
