"""The llama.cpp parity check's skip without llama-server (it needs a build of ~30 min)."""

from pathlib import Path

import pytest

from loadtest import llamacpp_parity


def test_without_llama_server_it_says_how_to_build_it_and_exits_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert llamacpp_parity.main(["--llama-server", str(tmp_path / "none"), "--out",
                                 str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "no llama-server" in said and "make bench-llamacpp" in said
    assert not (tmp_path / "out").exists()
