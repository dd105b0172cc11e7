"""tests/gpu/run.sh --dry-run: the device script, every section, on the CPU with builtin:tiny
and toy sizes, so that the one prepared GPU run cannot fail on a rotten script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_script_runs_every_section_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    env.pop("GPU_CHECK_T0", None)
    proc = subprocess.run(["bash", "tests/gpu/run.sh", "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sections"] == dict.fromkeys(
        ["a_correctness", "b_speed", "c_memory", "d_abort", "e_host", "f_guided"], "ok")
    a = json.loads((tmp_path / "a_correctness.json").read_text())["result"]
    for model in ("llama", "builtin"):
        assert a[model]["preemptions"] > 0 and a[model]["graphs"]["static_ticks"] > 0
        assert a[model]["sequences_ok"] == a[model]["sequences"] == 5
    b = json.loads((tmp_path / "b_speed.json").read_text())["result"]
    assert set(b["ratios"]) == {"tok_s_1", "tok_s_4", "tok_s_8", "mix_tok_s"}
    assert b["ours_graphs"]["mix_cold_tok_s"] > 0 and b["ours_eager"]["mix_cold_tok_s"] > 0
    c = json.loads((tmp_path / "c_memory.json").read_text())["result"]
    assert c["cpu_refusal"]["ok"] and c["errors"] == 0
    d = json.loads((tmp_path / "d_abort.json").read_text())["result"]
    assert d["prefill_tokens_of_queued_drops"] == 0 and d["tick_ms"] > 0
    e = json.loads((tmp_path / "e_host.json").read_text())["result"]
    for level in ("4", "8"):
        assert e["sim"][level]["us_per_seq"] > 0 and e["sim"][level]["ticks"] == 10
        ours = e["model_runner"][level]
        assert 0 < ours["forward_us"] < ours["tick_us"] and "outside_forward_us_per_seq" in ours
    assert e["graphs"]["static_ticks"] > 0 and len(e["goals"]) == 1
    f = json.loads((tmp_path / "f_guided.json").read_text())["result"]
    assert f["validity"]["valid_rate"] == 1.0 and f["tool_call"]["ok"]
    assert f["tool_call"]["finish"] == "tool_calls" and f["streams"] == 4
    rate = f["overhead"]["median_tok_per_s"]
    assert rate["constrained"] > 0 and rate["unconstrained"] > 0
    assert set(f["goals"]) == {"valid == 100%", "overhead <= 10%"}
    assert "section" in (tmp_path / "log.txt").read_text()  # the closing table
