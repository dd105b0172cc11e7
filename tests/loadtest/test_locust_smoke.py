"""A short headless locust run against a real tether pair (the `make loadtest` path, shrunk)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_locust_smoke_run_passes_its_checks(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {**os.environ, "LT_CHURN": "0.5", "LT_MAX_TOKENS": "16"}
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.run_locust", "--duration", "15",
         "--users", "10", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=170, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    with open(out / "locust_stats.csv", newline="") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    assert int(rows[("", "Aggregated")]["Request Count"]) > 0
    assert any(kind == "METRIC" and name.startswith("ttft_ms") for kind, name in rows)

    checks = json.loads((out / "loadtest_checks.json").read_text())
    assert checks["problems"] == []
    assert checks["figures"]["dropped_sequences"] > 0
