"""Shared by the tests of tether/: notifications, unit files and a child's environment."""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tether.sdnotify import Notification, NotifyListener

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "systemd"
INSTALLED_TETHER = "/usr/local/bin/tether"


def wait_notification(listener: NotifyListener, pid: int, key: str, value: str,
                      timeout: float, alive: Callable[[], bool]) -> list[Notification]:
    """Notifications from `pid` up to and including the first `key=value`."""
    seen: list[Notification] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for note in listener.receive():
            if note.pid == pid:
                seen.append(note)
                if note.fields.get(key) == value:
                    return seen
        if not alive():
            raise AssertionError(f"process {pid} exited before sending {key}={value}")
        time.sleep(0.02)
    raise AssertionError(f"no {key}={value} from pid {pid} in {timeout:.0f} s; got {seen}")


def unit_settings(unit: Path) -> dict[str, list[str]]:
    """key -> values of a unit file (all sections; keys in our units are unique per section)."""
    out: dict[str, list[str]] = {}
    # A trailing backslash continues a line (systemd joins them with a space).
    for raw in unit.read_text().replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def unit_command(unit: Path) -> list[str]:
    """ExecStart=, with the installed `tether` replaced by this checkout run by this Python."""
    argv = shlex.split(unit_settings(unit)["ExecStart"][0])
    assert argv[0] == INSTALLED_TETHER, f"{unit.name}: ExecStart must run {INSTALLED_TETHER}"
    return [sys.executable, "-m", "tether.cli", *argv[1:]]


def unit_environment(unit: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for value in unit_settings(unit).get("Environment", []):
        for item in shlex.split(value):
            key, _, val = item.partition("=")
            env[key] = val
    return env


# The model a test's processes serve unless it names one: random weights that load at once (the
# default, a real model, is for people; tests that want it say so).
TEST_MODEL = "builtin:tiny"


def child_env(**overrides: str) -> dict[str, str]:
    """This environment minus anything a supervisor would set, the tests' model, and
    `overrides`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TETHER_", "NOTIFY_", "WATCHDOG_", "LISTEN_", "JOURNAL_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["TETHER_MODEL"] = TEST_MODEL
    env.update(overrides)
    return env
