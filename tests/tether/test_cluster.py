"""`tether cluster`: N pairs behind smg sharing one SQLite store; Ctrl-C stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.serve import Serve
from tests.support.systemd import child_env
from tests.support.wait import free_port, free_port_block, wait_for
from tether.cluster import replica_settings
from tether.settings import Settings

pytestmark = pytest.mark.timeout(300)


def announced(proc: subprocess.Popen[bytes], log: Path, text: str) -> bool:
    """The cluster printed `text`; AssertionError with its log if it exited instead."""
    seen = log.read_text(errors="replace")
    assert proc.poll() is None or text in seen, f"the cluster exited {proc.returncode}:\n{seen[-3000:]}"
    return text in seen


def test_cluster_serves_through_smg_shares_the_store_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    port = free_port_block(4)  # smg, two replicas, smg's metrics
    log = tmp_path / "cluster.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether.cli", "cluster", "--replicas", "2", "--port", str(port),
         "--runtime-dir", str(tmp_path / "run"), "--state-dir", str(tmp_path / "state"),
         "--threads", "1", "--drain-timeout-s", "2", "--log-format", "text",
         "--model", "builtin:tiny"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: announced(proc, log, "tether cluster: 2 replicas behind smg"),
                 180, lambda: f"the cluster's announcement\n{log.read_text(errors='replace')[-3000:]}")
        replicas = [f"http://127.0.0.1:{replica_settings(Settings(port=port), i).port}"
                    for i in range(2)]
        router = f"http://127.0.0.1:{port}"
        ids = []
        for i in range(4):
            r = httpx.post(router + "/v1/responses", timeout=60.0, json={
                "model": "builtin:tiny", "input": f"hello {i}", "max_output_tokens": 3})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        for url in replicas:  # one SQLite file (WAL) shared by both pairs
            for rid in ids:
                assert httpx.get(f"{url}/v1/responses/{rid}", timeout=30.0).status_code == 200
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 5  # smg, and a launcher + daemon + proxy per replica
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        _gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_key_over_every_route_is_refused_as_smg_could_not_probe_the_replicas(
        tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tether.cli", "cluster", "--api-key", "k", "--api-key-scope",
         "all", "--runtime-dir", str(tmp_path / "run"), "--log-format", "text"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "--api-key-scope all" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()  # refused before any replica started


def test_a_cluster_on_a_directory_a_pair_holds_is_refused(tmp_path: Path) -> None:
    """Each replica owns its runtime directory (--runtime-dir/replica-i) as any pair does: a
    cluster whose replica's directory is taken stops, naming it, and the pair keeps serving."""
    taken = tmp_path / "run" / "replica-0"  # where `tether cluster` puts replica 0
    # The later --runtime-dir wins over the one Serve gives.
    holder = Serve(tmp_path, free_port(), extra=["--model", "sim:5", "--runtime-dir", str(taken)])
    try:
        holder.wait_ready()
        done = subprocess.run(
            [sys.executable, "-m", "tether.cli", "cluster", "--replicas", "1", "--port",
             str(free_port_block(3)), "--runtime-dir", str(tmp_path / "run"), "--state-dir",
             str(tmp_path / "other"), "--model", "sim:5", "--log-format", "text"],
            capture_output=True, text=True, env=child_env(), timeout=120)
        said = done.stdout + done.stderr
        assert done.returncode == 1, said
        assert f"runtime directory {taken} is in use" in said, said
        assert holder.health() == 200
    finally:
        holder.proc.send_signal(signal.SIGTERM)
        assert holder.proc.wait(60) == 0


def test_kill_9_of_the_cluster_leaves_no_orphans(tmp_path: Path) -> None:
    port = free_port_block(3)  # smg, one replica, smg's metrics
    log = tmp_path / "cluster.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether.cli", "cluster", "--replicas", "1", "--port", str(port),
         "--runtime-dir", str(tmp_path / "run"), "--state-dir", str(tmp_path / "state"),
         "--threads", "1", "--log-format", "text"], stdout=open(log, "wb"),
        stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: announced(proc, log, "tether cluster: 1 replicas"), 180,
                 lambda: f"the cluster's announcement\n{log.read_text(errors='replace')[-3000:]}")
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        proc.wait()
        _gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
