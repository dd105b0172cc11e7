"""The runtime directory's locks: one daemon and one proxy hold it, a second of either is refused
naming the holder, and a dead holder's file is taken over. (flock(2) locks belong to an open file,
so two opens in this one process contend as two processes would; tests/tether/test_launcher.py
runs the real processes.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ipc.dir_lock import Role, RuntimeDirInUse, check_free, lock_path, take


def test_the_daemon_and_the_proxy_of_one_pair_both_hold_the_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    daemon, proxy = take(run, Role.DAEMON), take(run, Role.PROXY)
    try:
        assert (run.stat().st_mode & 0o777) == 0o700  # created as the FIFOs' directory
        for role in Role:
            assert lock_path(run, role).read_text() == f"{os.getpid()}\n"
    finally:
        daemon.release()
        proxy.release()


@pytest.mark.parametrize("role", list(Role))
def test_a_second_holder_of_a_role_is_refused_naming_the_holder(tmp_path: Path,
                                                                  role: Role) -> None:
    first = take(tmp_path, role)
    try:
        with pytest.raises(RuntimeDirInUse) as refused:
            take(tmp_path, role)
        message = str(refused.value)
        assert str(tmp_path) in message and f"tether {role}" in message
        assert f"pid {os.getpid()}" in message and "--runtime-dir" in message
        with pytest.raises(RuntimeDirInUse):
            check_free(tmp_path)  # what `tether serve` asks before starting its children
        assert lock_path(tmp_path, role).read_text() == f"{os.getpid()}\n"  # left as it was
    finally:
        first.release()
    take(tmp_path, role).release()  # a restarted process takes it back
    check_free(tmp_path)


def test_a_dead_holders_lock_is_taken_over_silently(tmp_path: Path) -> None:
    # A process that took the lock and was killed: its file stays, naming a pid now gone.
    code = (f"from ipc.dir_lock import take, Role; take({str(tmp_path)!r}, Role.DAEMON); "
            "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    dead = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert dead.returncode == -9
    path = lock_path(tmp_path, Role.DAEMON)
    assert path.read_text().strip().isdigit() and path.read_text() != f"{os.getpid()}\n"
    check_free(tmp_path)
    lock = take(tmp_path, Role.DAEMON)
    try:
        assert path.read_text() == f"{os.getpid()}\n"
    finally:
        lock.release()
