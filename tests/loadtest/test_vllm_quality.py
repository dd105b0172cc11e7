"""vllm_quality's skip without vLLM (its measurement needs vLLM's CPU build: docs/benchmarks.md
has its figures)."""

from pathlib import Path

import pytest

from loadtest import vllm_quality


def test_without_vllm_it_says_how_to_install_and_exits_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert vllm_quality.main(["--vllm-venv", str(tmp_path / "none"), "--out",
                              str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "vLLM is not installed" in said and "make bench-vllm" in said
    assert not (tmp_path / "out").exists()
