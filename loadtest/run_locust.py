"""Run the locust load test against a fresh tether pair (or a given server).

    python -m loadtest.run_locust                      # 30 s, 20 users, builtin:tiny
    DURATION=60 USERS=50 python -m loadtest.run_locust
    python -m loadtest.run_locust --base-url http://127.0.0.1:8000 -- --lt-churn 0.5

Environment: DURATION (s, default 30), USERS (default 20), SPAWN_RATE (default USERS),
MODEL (default builtin:tiny), MAX_NUM_SEQS (default: the server's), plus the LT_* variables
the locustfile reads. Arguments after ``--`` go to locust unchanged.
Writes report.html, locust_*.csv, loadtest_checks.json and server.log (own pair) under
results/loadtest-<timestamp>/ (or --out) and exits with locust's exit code.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from loadtest.pair import REPO, ServerPair, raise_fd_limit
from loadtest.report import results_dir

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"


def locust_command(host: str, duration_s: float, users: int, spawn_rate: float, out: Path,
                   model: str | None, extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
            "--host", host, "-u", str(users), "-r", str(spawn_rate), "-t", f"{duration_s:g}s",
            "--stop-timeout", "30", "--csv", str(out / "locust"), "--html",
            str(out / "report.html"), "--only-summary", "--loglevel", "WARNING",
            "--lt-out", str(out), *(["--lt-model", model] if model else []), *extra]


def run_locust(host: str, duration_s: float, users: int, spawn_rate: float, out: Path,
               model: str | None, extra: Sequence[str] = ()) -> int:
    cmd = locust_command(host, duration_s, users, spawn_rate, out, model, extra)
    print("$", " ".join(cmd), flush=True)
    # From the repository root, which `python -m` puts on sys.path: the locustfile, loaded by
    # path, imports the rest of the loadtest package.
    return subprocess.run(cmd, cwd=REPO, check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=float(env("DURATION", "30")))
    parser.add_argument("--users", type=int, default=int(env("USERS", "20")))
    parser.add_argument("--spawn-rate", type=float, default=None)
    parser.add_argument("--model", default=env("MODEL", "builtin:tiny"),
                        help="model our own pair loads")
    seqs = env("MAX_NUM_SEQS")
    parser.add_argument("--max-num-seqs", type=int, default=int(seqs) if seqs else None)
    parser.add_argument("--base-url", default=None, help="test this server instead of our own")
    parser.add_argument("--out", default=None, help="results directory")
    parser.add_argument("locust_args", nargs="*", help="after --: passed to locust")
    args = parser.parse_args(argv)
    spawn = args.spawn_rate or float(env("SPAWN_RATE", "0") or 0) or args.users
    out = results_dir(args.out, "loadtest")
    raise_fd_limit()

    pair = None
    if args.base_url:
        host = args.base_url.rstrip("/")
    else:
        pair = ServerPair(model=args.model, max_num_seqs=args.max_num_seqs).start()
        host = pair.base_url
        print(f"tether pair up at {host} (log {pair.log_path})", flush=True)
    try:
        # The locustfile asks /v1/models for the name to send.
        code = run_locust(host, args.duration, args.users, spawn, out, None, args.locust_args)
    finally:
        if pair is not None:
            shutil.copy(pair.log_path, out / "server.log")
            stop_code = pair.stop()
            print(f"tether pair stopped (exit {stop_code})", flush=True)
    print(f"locust exit code {code}; results in {out}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
