"""`tether cluster --replicas N`: N pairs on one machine behind the SGLang Model Gateway (smg).

Each replica is a `tether serve` child (so each pair keeps its own supervisor, restarts and all)
with its own port (``--port`` + 1 + i), runtime directory and replica id; all share one response
store: SQLite in WAL mode under ``--state-dir``, or ``--state-url``. smg listens on ``--port``.
Ctrl-C sends SIGTERM to smg and every replica at once; each drains its in-flight requests.

smg is the router, never one of our own. It forwards generation, ``POST /v1/responses`` (with
``previous_response_id`` and ``background``) and ``POST /v1/responses/{id}/cancel`` (to every
worker: the one whose store knows the id answers). It answers ``GET``/``DELETE
/v1/responses/{id}`` and ``…/input_items`` from its own history layer, which never sees what HTTP
workers store; send those to any replica (they share the store) — the printout says where.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tether.launcher import child_environ, orphan_guard
from tether.settings import Settings

log = logging.getLogger("tether.cluster")

POLICIES = ("round_robin", "power_of_two", "cache_aware", "random", "least_load")
READY_TIMEOUT_S = 300.0
STOP_GRACE_S = 5.0
HEALTH_INTERVAL_S = 2  # smg's probe of each replica's /health


def smg_path() -> str | None:
    """The smg launcher of this environment, else the one on PATH."""
    beside = Path(sys.executable).parent / "smg"
    return str(beside) if beside.exists() else shutil.which("smg")


def smg_command(smg: str, worker_urls: list[str], host: str, port: int, metrics_port: int,
                policy: str = "round_robin", drain_s: float = 10.0,
                api_key: str | None = None) -> list[str]:
    """smg in front of tether replicas: health on /health, 503s retried on another replica."""
    cmd = [smg, "launch", "--worker-urls", *worker_urls, "--policy", policy,
           "--host", host, "--port", str(port),
           "--prometheus-host", host, "--prometheus-port", str(metrics_port),
           "--health-check-endpoint", "/health",
           "--health-check-interval-secs", str(HEALTH_INTERVAL_S),
           "--health-failure-threshold", "2", "--health-success-threshold", "1",
           # A replica whose daemon is away answers 503 at once: retry elsewhere, quickly.
           "--retry-max-retries", "3", "--retry-initial-backoff-ms", "20",
           "--retry-max-backoff-ms", "500",
           # tether's store answers the Responses API; smg keeps no history of its own.
           "--history-backend", "none",
           "--shutdown-grace-period-secs", str(max(1, int(drain_s))),
           "--disable-tokenizer-autoload", "--log-level", "warn"]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd


def replica_settings(s: Settings, i: int) -> Settings:
    """Replica `i`: its own port and runtime directory, the shared store."""
    state_url = s.state_url or f"sqlite:///{(s.state_dir / 'responses.sqlite3').resolve()}"
    port = s.port + 1 + i
    return dataclasses.replace(
        s, port=port, runtime_dir=s.runtime_dir / f"replica-{i}", state_url=state_url,
        replica_id=f"{s.replica_id or socket.gethostname()}:{port}", api_key=list(s.api_key))


def _healthy(url: str, path: str = "/health") -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url + path, timeout=2.0) as r:
            return bool(r.status == 200)
    except OSError:
        return False


class Cluster:
    def __init__(self, s: Settings, replicas: int, policy: str) -> None:
        self.settings = s
        self.replicas = [replica_settings(s, i) for i in range(replicas)]
        self.policy = policy
        self.procs: list[subprocess.Popen[bytes]] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.stop_signals = 0

    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{r.port}" for r in self.replicas]

    def run(self) -> int:
        if self.settings.api_key_scope == "all":
            # smg 1.13 probes each replica's /health without its --api-key: every replica
            # would be taken for down.
            log.error("--api-key-scope all: smg's health checks send no key; run the cluster "
                      "with --api-key-scope api (/health, /metrics and /openapi.json open)")
            return 1
        smg = smg_path()
        if smg is None:
            log.error("smg is not installed: pip install 'tether[cluster]'")
            return 1
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            for r in self.replicas:
                env = child_environ(r, "")
                env.pop("NOTIFY_SOCKET")
                env.pop("WATCHDOG_USEC")
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tether.cli", "serve"], env=env,
                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=orphan_guard()))
            if not self._wait_ready():
                return 1
            self.router = subprocess.Popen(
                smg_command(smg, self.urls(), self.settings.host, self.settings.port,
                            self.settings.port + len(self.replicas) + 1, self.policy,
                            self.settings.drain_timeout_s,
                            self.settings.api_key[0] if self.settings.api_key else None),
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=orphan_guard())
            if not self._wait_router():
                return 1
            self._announce()
            return self._supervise()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop_signals += 1

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = set(self.urls())
        while pending and self.stop_signals == 0 and time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                log.error("a replica stopped before it was ready; stopping")
                return False
            pending = {u for u in pending if not _healthy(u)}
            time.sleep(0.2)
        return not pending

    def _wait_router(self) -> bool:
        """Until smg answers /readiness: its first health checks of the replicas passed."""
        assert self.router is not None
        url = f"http://127.0.0.1:{self.settings.port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while self.stop_signals == 0 and time.monotonic() < deadline:
            if self.router.poll() is not None:
                log.error("smg exited with status %s before it was ready", self.router.returncode)
                return False
            if _healthy(url, "/readiness"):
                return True
            time.sleep(0.2)
        return False

    def _announce(self) -> None:
        s = self.settings
        print(f"tether cluster: {len(self.replicas)} replicas behind smg at "
              f"http://{s.host}:{s.port} ({self.policy}); replicas at {', '.join(self.urls())}; "
              f"store {self.replicas[0].state_url.split('@')[-1]}\n"
              f"  stored responses (GET/DELETE /v1/responses/{{id}}, input_items): any replica,"
              f" e.g. {self.urls()[0]}; Ctrl-C stops everything", flush=True)

    def _supervise(self) -> int:
        while self.stop_signals == 0:
            if self.router is not None and self.router.poll() is not None:
                log.error("smg exited with status %s; stopping", self.router.returncode)
                return 1
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    log.error("replica %d exited with status %s; stopping", i, p.returncode)
                    return 1
            time.sleep(0.2)
        return 0

    def _stop_all(self) -> None:
        ordered = ([self.router] if self.router else []) + self.procs
        for p in ordered:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.drain_timeout_s + STOP_GRACE_S
        for p in ordered:
            while p.poll() is None and time.monotonic() < deadline and self.stop_signals < 2:
                time.sleep(0.05)
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)  # each child leads its own session
        except ProcessLookupError:
            pass


def run(s: Settings, replicas: int, policy: str) -> int:
    return Cluster(s, replicas, policy).run()
