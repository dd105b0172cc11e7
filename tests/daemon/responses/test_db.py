"""The SQLite database under the store, as several processes share one file."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from daemon.responses.db import SQLiteDatabase


def test_a_second_connection_keeps_the_wal_of_the_first_safe_from_other_processes(
        tmp_path: Path) -> None:
    # Opening the file again (as the watcher's connection does) must not drop this process's
    # locks: another process closing its connection would then delete the WAL in use.
    path = tmp_path / "responses.sqlite3"
    db = SQLiteDatabase(path)
    db.execute("CREATE TABLE t (x INTEGER)")
    watcher = db.for_thread()
    other = subprocess.Popen([sys.executable, "-c",
                              f"import sqlite3, time; c = sqlite3.connect({str(path)!r}); "
                              "c.execute('SELECT count(*) FROM t').fetchall(); time.sleep(1); "
                              "c.close()"])
    time.sleep(0.5)
    db.execute("INSERT INTO t VALUES (1)")
    assert other.wait(10) == 0
    db.execute("INSERT INTO t VALUES (2)")
    assert sqlite3.connect(str(path)).execute("SELECT count(*) FROM t").fetchone()[0] == 2
    assert (path.parent / "responses.sqlite3-wal").exists()
    watcher.close()
    db.close()


def test_a_new_file_is_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "responses.sqlite3"
    SQLiteDatabase(path).close()
    assert path.stat().st_mode & 0o777 == 0o600
