"""`tether serve`: the daemon and the proxy as two supervised child processes.

The launcher plays systemd for a terminal session, so `make serve` behaves like the unit pair:
it binds its own NOTIFY_SOCKET and waits for READY=1 from each child (a start EXTEND_TIMEOUT_USEC
pushes later), enforces WATCHDOG=1 from a child's first ping on, restarts a child that exits
without being asked to, whatever its status (with backoff), and on Ctrl-C or SIGTERM sends
SIGTERM to both, waits past the drain timeout and SIGKILLs what is left (KillMode=mixed).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import FrameType

import tether
from ipc import dir_lock
from ipc.pipes import PipeError, ensure_fifos
from ipc.processes import describe_exit, die_with_parent
from tether.sdnotify import Notification, NotifyListener
from tether.settings import Settings, env_name

log = logging.getLogger("tether.launcher")

WATCHDOG_S = 30.0  # WatchdogSec= of both units
START_TIMEOUT_S = 300.0  # TimeoutStartSec= of tether-daemon.service: loading a model is slow
RESTART_FIRST_S = 0.5
RESTART_MAX_S = 10.0
STABLE_S = 30.0  # a child up this long starts its next backoff afresh
STOP_GRACE_S = 5.0  # on top of the drain timeout before SIGKILL
TICK_S = 0.5
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class State(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    BACKING_OFF = "waiting to restart"
    STOPPED = "stopped"


@dataclasses.dataclass(slots=True)
class Child:
    name: str  # also the subcommand: "daemon" | "proxy"
    proc: subprocess.Popen[bytes] | None = None
    state: State = State.STOPPED
    start_deadline: float = 0.0  # moved later by EXTEND_TIMEOUT_USEC while starting
    ready_at: float = 0.0
    last_ping: float | None = None  # the first WATCHDOG=1 arms the watchdog, ready or not
    num_failures: int = 0
    restart_at: float | None = None


def child_environ(s: Settings, notify_socket: str) -> dict[str, str]:
    """The environment of a child: every setting as TETHER_*, so no secret shows in `ps`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TETHER_", "LISTEN_", "WATCHDOG_"))}
    for f in dataclasses.fields(Settings):
        value = getattr(s, f.name)
        text = ",".join(value) if isinstance(value, list) else "" if value is None else str(value)
        env[env_name(f.name)] = text
    env["NOTIFY_SOCKET"] = notify_socket
    env["WATCHDOG_USEC"] = str(int(WATCHDOG_S * 1_000_000))
    # The children must run the same code as this process, installed or not.
    root = str(Path(tether.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def orphan_guard() -> functools.partial[None]:
    """A child's preexec_fn: SIGTERM when this process dies, even by SIGKILL (no orphans)."""
    return functools.partial(die_with_parent, os.getpid(), signal.SIGTERM)


def _usec(note: Notification, key: str) -> float | None:
    """A notification's microseconds field in seconds; None if absent or not a number."""
    try:
        return int(note.fields[key]) / 1_000_000
    except (KeyError, ValueError):
        return None


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # each child leads its own process group
    except (ProcessLookupError, PermissionError):
        pass


class Launcher:
    def __init__(self, s: Settings) -> None:
        self.settings = s
        self.children = [Child("daemon"), Child("proxy")]
        self.listener = NotifyListener()
        self.num_stop_signals = 0
        self.announced = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener.fileno(), selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)

    # --- lifecycle ------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            # Refused before either child touches the FIFOs: another pair's are live there.
            dir_lock.check_free(self.settings.runtime_dir, self.settings.pipe_group)
            fifos = ensure_fifos(self.settings.runtime_dir, self.settings.pipe_group)
        except PipeError as exc:
            log.error("%s", exc)
            self.close()
            return 1
        print(f"tether: FIFOs {', '.join(str(p) for p in fifos.values())}", flush=True)
        previous = self._install_signals()
        try:
            for child in self.children:
                self._start(child)
            code = self._supervise()
            self._stop_children()
            return code
        finally:
            signal.set_wakeup_fd(-1)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()

    def close(self) -> None:
        self._selector.close()
        self.listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _install_signals(self) -> dict[int, signal._HANDLER]:
        previous: dict[int, signal._HANDLER] = {}
        for sig in (*STOP_SIGNALS, signal.SIGCHLD):
            previous[sig] = signal.signal(sig, self._on_signal)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        return previous

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGCHLD:
            return  # the wakeup fd already woke the loop; _reap() does the work
        self.num_stop_signals += 1

    def _supervise(self) -> int:
        """Until asked to stop: 0, or 1 when a child fails before the pair was first ready."""
        while self.num_stop_signals == 0:
            self._wait(self._next_timeout())
            self._on_notifications(self.listener.receive())
            if self._reap() and not self.announced:
                return 1
            self._enforce_deadlines()
            self._start_due()
        return 0

    def _stop_children(self) -> None:
        if self.num_stop_signals:
            print("tether: stopping (again to kill at once)", flush=True)
        running = [c for c in self.children if c.proc is not None]
        for child in self.children:
            child.restart_at = None
            if child.proc is not None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.drain_timeout_s + STOP_GRACE_S
        while (any(c.proc.poll() is None for c in running if c.proc)
               and time.monotonic() < deadline and self.num_stop_signals < 2):
            self._wait(min(TICK_S, max(0.0, deadline - time.monotonic())))
            # Still read while stopping: an unread datagram keeps the socket readable (select
            # would return at once, a busy spin), and a full queue drops the children's pings.
            self.listener.receive()
        for child in running:
            assert child.proc is not None
            if child.proc.poll() is None:
                log.warning("%s did not stop in time; killing it", child.name)
            # Like KillMode=mixed: whatever is left in the child's group goes too.
            _signal_group(child.proc, signal.SIGKILL)
            child.proc.wait()
            child.proc = None
            child.state = State.STOPPED

    # --- one child ------------------------------------------------------------------------------

    def _start(self, child: Child) -> None:
        argv = [sys.executable, "-m", "tether.cli", child.name]
        child.proc = subprocess.Popen(
            argv, env=child_environ(self.settings, self.listener.name),
            stdin=subprocess.DEVNULL, process_group=0,
            preexec_fn=orphan_guard(),
        )
        child.state = State.STARTING
        child.start_deadline = time.monotonic() + START_TIMEOUT_S
        child.last_ping = None
        child.restart_at = None
        log.info("started %s (pid %d)", child.name, child.proc.pid)

    def _reap(self) -> bool:
        """Collect exited children and schedule restarts; True if one exited."""
        exited = False
        now = time.monotonic()
        for child in self.children:
            if child.proc is None or (code := child.proc.poll()) is None:
                continue
            exited = True
            _signal_group(child.proc, signal.SIGKILL)
            was_ready = child.state is State.READY
            child.proc = None
            if not self.announced:
                log.error("%s %s before it was ready; stopping", child.name, describe_exit(code))
                child.state = State.STOPPED
                continue
            # Whatever its status: only the launcher stops the pair (a child sent SIGTERM on
            # its own drains and exits 0, and the proxy would answer 503 for good).
            if was_ready and now - child.ready_at >= STABLE_S:
                child.num_failures = 0
            delay = min(RESTART_FIRST_S * 2**child.num_failures, RESTART_MAX_S)
            child.num_failures += 1
            child.restart_at = now + delay
            child.state = State.BACKING_OFF
            log.warning("%s %s; restarting in %.1f s", child.name, describe_exit(code), delay)
        return exited

    def _start_due(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.state is State.BACKING_OFF and child.restart_at and child.restart_at <= now:
                self._start(child)

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.proc is None:
                continue
            if child.state is State.STARTING and now > child.start_deadline:
                log.error("%s not ready in time; killing it", child.name)
                _signal_group(child.proc, signal.SIGKILL)
            elif child.last_ping is not None and now - child.last_ping > WATCHDOG_S:
                log.error("%s sent no WATCHDOG=1 for %.0f s; killing it", child.name, WATCHDOG_S)
                _signal_group(child.proc, signal.SIGKILL)

    def _on_notifications(self, notifications: list[Notification]) -> None:
        now = time.monotonic()
        for note in notifications:
            # NotifyAccess=main: only a child's own main process speaks for it.
            child = next((c for c in self.children
                          if c.proc is not None and c.proc.pid == note.pid), None)
            if child is None:
                log.debug("ignoring notification from pid %s: %s", note.pid, note.fields)
                continue
            if note.fields.get("READY") == "1" and child.state is State.STARTING:
                child.state = State.READY
                child.ready_at = child.last_ping = now
                log.info("%s ready (pid %d)", child.name, note.pid)
            if child.state is State.STARTING and (extend := _usec(note, "EXTEND_TIMEOUT_USEC")):
                child.start_deadline = max(child.start_deadline, now + extend)
            if note.fields.get("WATCHDOG") == "1":
                child.last_ping = now
            elif note.fields.get("WATCHDOG") == "trigger" and child.proc is not None:
                log.error("%s asked for a watchdog restart", child.name)
                _signal_group(child.proc, signal.SIGKILL)
            if "STATUS" in note.fields:
                log.debug("%s status: %s", child.name, note.fields["STATUS"])
        if not self.announced and all(c.state is State.READY for c in self.children):
            self.announced = True
            self._announce()

    # --- plumbing -------------------------------------------------------------------------------

    def _next_timeout(self) -> float:
        now = time.monotonic()
        due = [c.restart_at - now for c in self.children if c.restart_at is not None]
        return max(0.0, min([TICK_S, *due]))

    def _wait(self, timeout: float) -> None:
        self._selector.select(timeout)
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def _base_url(self) -> str:
        host = self.settings.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.settings.port}"

    def _auth_headers(self) -> dict[str, str]:
        keys = self.settings.api_key
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    def _served_model(self) -> str:
        request = urllib.request.Request(self._base_url() + "/v1/models",
                                         headers=self._auth_headers())
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=2.0) as response:
                return str(json.load(response)["data"][0]["id"])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return self.settings.served_model_name or self.settings.model

    def _announce(self) -> None:
        url = self._base_url()
        pids = ", ".join(f"{c.name} pid {c.proc.pid}" for c in self.children if c.proc)
        auth = "-H 'Authorization: Bearer <your key>' " if self.settings.api_key else ""
        body = json.dumps({"model": self._served_model(), "prompt": "Once upon a time",
                           "max_tokens": 32, "stream": True})
        print(f"tether: ready at {url} ({pids}); Ctrl-C stops both\n"
              f"  curl -N {url}/v1/completions -H 'Content-Type: application/json' "
              f"{auth}-d '{body}'", flush=True)


def run(s: Settings) -> int:
    return Launcher(s).run()
