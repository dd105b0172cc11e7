"""Two real pairs sharing one PostgreSQL store, and the real smg router in front of them."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.metrics import m
from tests.support.pair import Server, start_server
from tests.support.wait import free_port, wait_for
from tether.cluster import smg_command, smg_path

LEASE_S = 3.0
MODEL = "builtin:tiny"  # smg routes by model, so requests through it name one


@dataclass
class RoutedCluster:
    tmp: Path
    state_url: str
    replicas: list[Server] = field(default_factory=list)
    router: subprocess.Popen[bytes] | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def start(self, n: int = 2) -> None:
        for i in range(n):
            d = self.tmp / f"replica-{i}"
            d.mkdir()
            self.replicas.append(start_server(d, [
                "--threads", "1", "--state-url", self.state_url,
                "--replica-lease-s", str(LEASE_S), "--drain-timeout-s", "2"]))
        smg = smg_path()
        assert smg is not None, "smg is a dev dependency: pip install -e '.[dev]'"
        self.port = free_port()
        self.router = subprocess.Popen(
            smg_command(smg, [r.url for r in self.replicas], "127.0.0.1", self.port, free_port(),
                        drain_s=1),
            stdout=open(self.tmp / "smg.log", "ab"), stderr=subprocess.STDOUT)
        self.wait_routed()

    def finished(self, i: int) -> float:
        return sum(v for k, v in self.replicas[i].metrics().items()
                   if k.startswith("tether_requests_finished_total"))

    def wait_routed(self, timeout: float = 60.0) -> None:
        """Until smg sends requests to every replica (its health checks have passed)."""
        seen = [self.finished(i) for i in range(len(self.replicas))]

        def every_replica_served() -> bool:
            try:
                httpx.post(self.url + "/v1/completions", timeout=10.0,
                           json={"model": MODEL, "prompt": "warm", "max_tokens": 1})
            except httpx.HTTPError:
                return False
            return all(self.finished(i) > seen[i] for i in range(len(self.replicas)))

        wait_for(every_replica_served, timeout, lambda: f"smg routing to every replica\n{self.logs()}")

    def restart_daemon(self, i: int) -> None:
        server = self.replicas[i]
        if server.daemon is not None and server.daemon.poll() is None:
            server.kill("daemon")
        server.start_daemon()
        server.wait_health(200)
        self.wait_routed()

    def running(self) -> list[float]:
        return [m(r.metrics(), "tether_requests_running") for r in self.replicas]

    def logs(self) -> str:
        smg_log = self.tmp / "smg.log"
        tail = smg_log.read_text(errors="replace")[-3000:] if smg_log.exists() else ""
        return "\n".join(r.logs() for r in self.replicas) + "\n--- smg ---\n" + tail

    def stop(self) -> None:
        if self.router is not None:
            self.router.kill()
            self.router.wait(10)
        for r in self.replicas:
            r.stop()
