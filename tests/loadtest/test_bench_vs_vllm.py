"""The vLLM comparison's turns, its skip without vLLM, and its medians and goals."""

import argparse
import json
from pathlib import Path

import pytest

from loadtest import bench_vs_vllm


def test_turns_alternate_and_back_to_back_reps_share_a_start() -> None:
    assert bench_vs_vllm.schedule(0, 4) == [("tether", [0]), ("vllm", [0, 1]),
                                            ("tether", [1, 2]), ("vllm", [2, 3]), ("tether", [3])]
    # A run that adds to earlier reps keeps the alternation where they left it.
    assert bench_vs_vllm.schedule(1, 1) == [("vllm", [1]), ("tether", [1])]


def test_without_vllm_it_says_how_to_install_and_exits_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_vs_vllm.main(["--vllm-venv", str(tmp_path / "none"), "--out",
                               str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "vLLM is not installed" in said and "make bench-vllm" in said
    assert not (tmp_path / "out").exists()


def run(server: str, rep: int, tok: float, cold: float, idle: float | None) -> dict:
    return {"server": server, "rep": rep, "decode": {"1": {"tok_per_s": tok}},
            "cold_ttft_s": cold, "prefix_ttft_s": cold / 10,
            "aborts": [{"after_close": 0.0, "idle_s": idle}]}


def test_medians_ratios_and_goals() -> None:
    runs = [run("tether", 0, 50, 3.0, 0.02), run("vllm", 0, 30, 4.0, 0.2),
            run("tether", 1, 46, 3.4, None), run("vllm", 1, 30, 4.0, 0.1)]
    got = bench_vs_vllm.summarize({"runs": runs})
    assert got["tether"]["decode"] == {"1": 48}
    assert got["decode_ratio"]["1"] == pytest.approx(1.6) and got["decode_pass"]
    assert got["cold_ratio"] == pytest.approx(0.8) and got["cold_pass"]
    # An abort that never read 0 running is counted apart, not as a time.
    assert got["tether"]["idle_s"] == 0.02 and got["tether"]["never_idle"] == 1


def test_a_bf16_run_reports_issue_37s_goals(capsys: pytest.CaptureFixture[str]) -> None:
    runs = [run("tether", 0, 50, 3.0, 0.02), run("vllm", 0, 25, 4.0, 0.2)]
    res = {"runs": runs, "dtype": "bfloat16", "gguf": "/x/SmolLM2.Q4_1.gguf", "threads": 2,
           "max_tokens": 64, "abort_after": 8}
    res["summary"] = bench_vs_vllm.summarize(res)
    bench_vs_vllm.report(res)
    said = capsys.readouterr().out
    assert "SmolLM2.Q4_1.gguf dequantized in bfloat16" in said
    assert "(issue 37, bfloat16)" in said and "issue 24" not in said


def test_reps_of_another_dtype_or_weights_are_not_mixed(tmp_path: Path) -> None:
    path = tmp_path / "vs_vllm.json"
    path.write_text(json.dumps({"runs": [run("tether", 0, 50, 3.0, 0.02)],
                                "model_dir": "/m", "dtype": "float32"}))
    same = argparse.Namespace(dtype="float32", model_dir=Path("/m"))
    assert len(bench_vs_vllm.earlier_reps(path, same)["runs"]) == 1
    for other in (argparse.Namespace(dtype="bfloat16", model_dir=Path("/m")),
                  argparse.Namespace(dtype="float32", model_dir=Path("/other"))):
        with pytest.raises(SystemExit, match="give another --out"):
            bench_vs_vllm.earlier_reps(path, other)
