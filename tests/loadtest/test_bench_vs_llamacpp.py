"""The llama.cpp comparison's skip without llama-server, and its medians and goals."""

from pathlib import Path

import pytest

from loadtest import bench_vs_llamacpp


def test_without_llama_server_it_says_how_to_build_it_and_exits_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_vs_llamacpp.main(["--llama-server", str(tmp_path / "none"), "--out",
                                   str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "llama-server is not built" in said and "make bench-llamacpp" in said
    assert not (tmp_path / "out").exists()


def run(server: str, rep: int, one: float, eight: float, cold: float) -> dict:
    return {"server": server, "rep": rep, "load_average": [1.0, 1.0, 1.0],
            "decode": {"1": {"tok_per_s": one}, "8": {"tok_per_s": eight}},
            "cold_ttft_s": cold, "prefix_ttft_s": cold / 10,
            "aborts": [{"after_close": 0.0, "idle_s": 0.02}]}


def test_medians_ratios_and_each_batchs_goal() -> None:
    runs = [run("tether", 0, 130, 300, 1.0), run("llamacpp", 0, 100, 200, 4.0),
            run("tether", 1, 120, 280, 1.4), run("llamacpp", 1, 100, 200, 4.0)]
    got = bench_vs_llamacpp.summarize({"runs": runs})
    assert got["tether"]["decode"] == {"1": 125, "8": 290}
    assert got["decode_ratio"]["1"] == pytest.approx(1.25) and not got["decode_pass"]["1"]
    assert got["decode_ratio"]["8"] == pytest.approx(1.45) and not got["decode_pass"]["8"]
    assert got["cold_ratio"] == pytest.approx(0.3) and got["cold_pass"]
