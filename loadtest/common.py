"""Shared by the load test and the benchmarks: a server pair, /metrics, results, plots.

Scripts in this directory import it as a sibling module (``import common``); they are run as
``python loadtest/<script>.py`` so their directory is first on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
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
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"

# Gauges that must return to their idle value once load stops.
SETTLE_GAUGES = ("tether_requests_running", "tether_requests_waiting",
                 "tether_kv_cache_blocks_used", "tether_conversation_placeholders")


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
                 extra_args: Sequence[str] = (), startup_timeout: float = 120.0) -> None:
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
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerPair:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=REPO, env=env, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tether serve exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            if health_ok(self.base_url):
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"tether serve not healthy after {self.startup_timeout:.0f} s:\n"
                           + self.log_tail())

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


# --- /metrics ------------------------------------------------------------------------------------

LabelSet = tuple[tuple[str, str], ...]


@dataclasses.dataclass(slots=True, frozen=True)
class Histogram:
    buckets: list[tuple[float, float]]  # (upper bound, cumulative count), sorted
    sum: float
    count: float

    def minus(self, before: Histogram) -> Histogram:
        old = dict(before.buckets)
        return Histogram([(le, c - old.get(le, 0.0)) for le, c in self.buckets],
                         self.sum - before.sum, self.count - before.count)

    def bucket(self, q: float) -> tuple[float, float] | None:
        """(lower, upper] bounds of the bucket holding the q-th observation: what is exact."""
        if self.count <= 0:
            return None
        lower = 0.0
        for le, cum in self.buckets:
            if cum >= q * self.count:
                return lower, le
            lower = le
        return lower, math.inf

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket holding the q-th observation."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le, cum in self.buckets:
            if cum >= rank:
                if math.isinf(le):
                    return lower
                span = cum - below
                return lower + (le - lower) * ((rank - below) / span if span else 1.0)
            lower, below = le, cum
        return lower


@dataclasses.dataclass(slots=True, frozen=True)
class Metrics:
    samples: dict[tuple[str, LabelSet], float]

    def has(self, name: str) -> bool:
        return any(n == name for n, _ in self.samples)

    def get(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, tuple(sorted(labels.items()))))

    def total(self, name: str) -> float:
        """Sum over every label set; 0 when the series is absent."""
        return sum(v for (n, _), v in self.samples.items() if n == name)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (n, labels), v in self.samples.items():
            if n == name:
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out

    def histogram(self, name: str) -> Histogram | None:
        buckets = [(float(dict(labels)["le"]), v) for (n, labels), v in self.samples.items()
                   if n == name + "_bucket"]
        if not buckets:
            return None
        return Histogram(sorted(buckets), self.total(name + "_sum"), self.total(name + "_count"))


def parse_metrics(text: str) -> Metrics:
    samples: dict[tuple[str, LabelSet], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return Metrics(samples)


def scrape(base_url: str, timeout: float = 5.0) -> Metrics:
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as r:
        return parse_metrics(r.read().decode())


def gauges(m: Metrics, names: Sequence[str] = SETTLE_GAUGES) -> dict[str, float]:
    return {n: m.total(n) for n in names}


def wait_settled(base_url: str, baseline: dict[str, float], within: float,
                 poll: float = 0.05) -> tuple[bool, dict[str, float], float]:
    """Poll until every gauge is at (or below) its baseline.

    Returns (settled, last gauges, seconds waited).
    """
    start = time.monotonic()
    while True:
        now = gauges(scrape(base_url), list(baseline))
        waited = time.monotonic() - start
        if all(now[k] <= baseline[k] for k in baseline):
            return True, now, waited
        if waited >= within:
            return False, now, waited
        time.sleep(poll)


# --- figures -------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict[str, float | int | None]:
    return {"n": len(values), "mean": sum(values) / len(values) if values else None,
            "p50": percentile(values, 0.5), "p90": percentile(values, 0.9),
            "p99": percentile(values, 0.99), "max": max(values) if values else None}


def results_dir(out: str | None, prefix: str) -> Path:
    path = Path(out) if out else RESULTS / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return path


def plot_cdf(path: Path, series: Mapping[str, Sequence[float]], xlabel: str, title: str,
             points: Mapping[str, Sequence[tuple[float, float]]] | None = None) -> Path:
    """Empirical CDFs of `series`, plus already-cumulative (x, fraction) `points`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in series.items():
        if values:
            xs = sorted(values)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)
    for label, pts in (points or {}).items():
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o--", label=label)
    if any(v > 0 for vs in series.values() for v in vs):
        ax.set_xscale("log")  # latencies span ms to seconds
    return _save(fig, ax, path, xlabel, "fraction", title)


def plot_lines(path: Path, xs: Sequence[float], series: Mapping[str, Sequence[float]],
               xlabel: str, ylabel: str, title: str, *, logx: bool = False,
               logy: bool = False, marker: str = "") -> Path:
    """One line per series over the shared `xs`; `marker` (e.g. "o") for sparse points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, ys in series.items():
        ax.plot(xs[: len(ys)], ys, marker=marker or None, label=label)
    if logx:
        ax.set_xscale("log")
        if len(xs) <= 12:  # few points (e.g. concurrency levels): label each one plainly
            from matplotlib.ticker import NullLocator

            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticks(list(xs), [f"{x:g}" for x in xs])
    if logy:
        ax.set_yscale("log")
    return _save(fig, ax, path, xlabel, ylabel, title)


def _save(fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def goal_line(name: str, value: float | None, goal: str, ok: bool | None, unit: str = "") -> str:
    shown = "n/a" if value is None else f"{value:.4g}{unit}"
    verdict = "n/a" if ok is None else ("PASS" if ok else "MISS")
    return f"  {name:<44} {shown:>14}   goal {goal:<18} {verdict}"


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
