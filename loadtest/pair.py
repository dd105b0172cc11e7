"""A `tether serve` pair on a free port for a benchmark, and the process helpers around it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tether_command() -> list[str]:
    script = Path(sys.executable).parent / "tether"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "tether.cli"]


def raise_fd_limit(want: int = 8192) -> None:
    """Lift the soft RLIMIT_NOFILE; servers started afterwards inherit it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class ServerPair:
    """`tether serve` on a free port with throw-away runtime and state directories."""

    def __init__(self, model: str = "builtin:tiny", max_num_seqs: int | None = None,
                 extra_args: Sequence[str] = (), startup_timeout: float = 120.0,
                 fd_limit: int | None = None, repo: Path = REPO) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.tmp = Path(tempfile.mkdtemp(prefix="tether-lt-"))
        self.log_path = self.tmp / "server.log"
        cmd = [*tether_command(), "serve", "--port", str(self.port),
               "--runtime-dir", str(self.tmp / "run"), "--state-dir", str(self.tmp / "state"),
               "--model", model]
        if max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(max_num_seqs)]
        self.cmd = [*cmd, *extra_args]
        self.startup_timeout = startup_timeout
        # Soft and hard open-files limit of the pair (as a systemd unit without LimitNOFILE
        # gives it: 1024); None: inherited.
        self.fd_limit = fd_limit
        self.proc: subprocess.Popen[bytes] | None = None
        self.repo = repo  # the checkout it runs (first on its PYTHONPATH)
        self.env: dict[str, str] = {}  # set over the inherited environment
        self.name = "tether serve"  # what its errors call it

    def start(self) -> ServerPair:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.repo),
                                                          env.get("PYTHONPATH")]))
        env.update(self.env)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.repo, env=env, start_new_session=True,
                                         preexec_fn=self._limit_fds)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            if health_ok(self.base_url):
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy after {self.startup_timeout:.0f} s:\n"
                           + self.log_tail())

    def _limit_fds(self) -> None:
        import resource

        if self.fd_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.fd_limit, self.fd_limit))

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def processes(self) -> dict[str, psutil.Process]:
        """The proxy and the daemon of the pair, by their ``tether.cli`` sub-command, else the
        proxy is the process listening on our port and the daemon the biggest other one."""
        assert self.proc is not None
        root = psutil.Process(self.proc.pid)
        tree = [root, *root.children(recursive=True)]
        found: dict[str, psutil.Process] = {}
        for p in tree:
            args = _cmdline(p)
            for role in ("proxy", "daemon"):
                if role in args[1:] and "serve" not in args:
                    found[role] = p
        if "proxy" not in found:
            for p in tree:
                with contextlib.suppress(psutil.Error):
                    if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port
                           for c in p.net_connections(kind="tcp")):
                        found["proxy"] = p
        if "daemon" not in found:
            others = [p for p in tree if p is not found.get("proxy") and p is not root]
            if others:
                found["daemon"] = max(others, key=_rss)
        return found

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        kids: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for kid in kids:
            with contextlib.suppress(psutil.Error):
                kid.wait(5)
            with contextlib.suppress(psutil.Error):
                kid.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)
        code = self.proc.returncode
        self.proc = None
        return code

    def __enter__(self) -> ServerPair:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _cmdline(p: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return p.cmdline()
    return []


def _rss(p: psutil.Process) -> int:
    with contextlib.suppress(psutil.Error):
        return int(p.memory_info().rss)
    return 0


def health_ok(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=2) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def served_model(base_url: str) -> str | None:
    """The first id of GET /v1/models (what requests should name), None if unavailable."""
    try:
        with urllib.request.urlopen(base_url + "/v1/models", timeout=5) as r:
            return str(json.load(r)["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


@contextlib.contextmanager
def server_or_url(base_url: str | None, **pair_kwargs: Any) -> Iterator[tuple[str, ServerPair | None]]:
    """Use the given server, or start our own pair for the duration of the block."""
    if base_url:
        yield base_url.rstrip("/"), None
        return
    pair = ServerPair(**pair_kwargs).start()
    try:
        yield pair.base_url, pair
    finally:
        pair.stop()
