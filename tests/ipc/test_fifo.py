"""ipc.fifo's ensure_fifos on a real filesystem: owner-only (or group) FIFOs in a private
directory, idempotent, refusing what it did not make."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

import pytest

from ipc.pipes import PipeError, ensure_fifos


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_ensure_fifos_creates_owner_only_fifos(tmp_path: Path) -> None:
    paths = ensure_fifos(tmp_path / "run")
    assert set(paths) == {"requests", "control", "tokens"}
    assert _mode(tmp_path / "run") == 0o700
    for path in paths.values():
        assert stat.S_ISFIFO(os.lstat(path).st_mode)
        assert _mode(path) == 0o600
    assert ensure_fifos(tmp_path / "run") == paths  # idempotent


def test_ensure_fifos_with_group_by_name_or_gid(tmp_path: Path) -> None:
    gid = os.getgid()
    for group in (grp.getgrgid(gid).gr_name, str(gid)):
        run = tmp_path / group
        for path in ensure_fifos(run, group).values():
            assert _mode(path) == 0o660
            assert os.lstat(path).st_gid == gid
        assert _mode(run) == 0o750


def test_ensure_fifos_refuses_an_unknown_group(tmp_path: Path) -> None:
    with pytest.raises(PipeError, match="no-such-group-xyz"):
        ensure_fifos(tmp_path / "run", "no-such-group-xyz")


def test_ensure_fifos_refuses_a_regular_file_in_place(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "control").write_text("not a pipe")
    with pytest.raises(PipeError, match=r"run/control: exists but is a regular file"):
        ensure_fifos(run)


def test_ensure_fifos_refuses_a_symlinked_dir(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PipeError, match="is a symlink, not a directory"):
        ensure_fifos(tmp_path / "run")


def test_ensure_fifos_fixes_a_loose_mode_on_our_own_fifo(tmp_path: Path) -> None:
    paths = ensure_fifos(tmp_path / "run")
    os.chmod(paths["tokens"], 0o666)
    os.chmod(tmp_path / "run", 0o777)
    ensure_fifos(tmp_path / "run")
    assert _mode(paths["tokens"]) == 0o600
    assert _mode(tmp_path / "run") == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a FIFO to another user")
def test_ensure_fifos_refuses_another_users_fifo(tmp_path: Path) -> None:
    paths = ensure_fifos(tmp_path / "run")
    os.chown(paths["requests"], 65534, -1)
    with pytest.raises(PipeError, match=r"run/requests: owned by uid 65534"):
        ensure_fifos(tmp_path / "run")
