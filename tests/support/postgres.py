"""A throwaway PostgreSQL cluster for tests: initdb + pg_ctl under a temporary directory, reached
only through a Unix socket there (no TCP). Under root (CI) it runs as the `postgres` user, as
PostgreSQL refuses to run as root. Each test takes its own schema, so tests share one server."""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import quote

_schemas = itertools.count()


def pg_bin_dir() -> Path | None:
    """Where initdb and pg_ctl are: on PATH, or Debian's /usr/lib/postgresql/N/bin."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(found).resolve().parent
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    return None


class Postgres:
    def __init__(self, bin_dir: Path, port: int = 5432) -> None:
        self.bin_dir = bin_dir
        self.port = port
        # Not under pytest's tmp_path: that is root's 0700 tree, which `postgres` cannot enter.
        self.dir = Path(tempfile.mkdtemp(prefix="tether-pg-"))
        self.data = self.dir / "data"
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    def _run(self, *argv: str) -> None:
        cmd = [*self._as, *argv]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=self.dir)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")

    def start(self) -> None:
        self._run(str(self.bin_dir / "initdb"), "-D", str(self.data), "-U", "postgres",
                  "--auth=trust", "--no-sync", "-E", "UTF8")
        options = (f"-k {self.dir} -c listen_addresses='' -p {self.port} -c fsync=off "
                   "-c max_connections=200")
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-o", options,
                  "-l", str(self.dir / "server.log"), "-w", "-t", "60", "start")

    def stop(self) -> None:
        try:
            self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                      "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def url(self, schema: str | None = None) -> str:
        """A URL for the `postgres` database; with `schema`, tables go there."""
        url = f"postgresql://postgres@/postgres?host={quote(str(self.dir))}&port={self.port}"
        if schema is not None:
            url += "&options=" + quote(f"-csearch_path={schema}")
        return url

    def new_schema(self) -> str:
        """A fresh, empty schema; returns the URL whose tables land in it."""
        import psycopg

        name = f"t{os.getpid()}_{next(_schemas)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {name}")
        return self.url(name)
