"""`tether serve` as a real process: the launcher with its daemon and proxy children."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import psutil

from tests.support.systemd import child_env
from tests.support.wait import wait_for

READY_TIMEOUT_S = 180.0
DRAIN_S = 2.0


class Serve:
    def __init__(self, tmp_path: Path, port: int, drain_s: float = DRAIN_S,
                 extra: list[str] | None = None) -> None:
        self.tmp = tmp_path
        self.port = port
        self.run_dir = tmp_path / "run"
        self.log_path = tmp_path / "serve.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tether.cli", "serve", "--runtime-dir", str(self.run_dir),
                 "--state-dir", str(tmp_path / "state"), "--port", str(port),
                 "--log-format", "json", "--drain-timeout-s", str(drain_s), *(extra or [])],
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


def gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
