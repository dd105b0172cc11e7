"""A model's own sampling defaults (vLLM's --generation-config auto): read from a checkpoint's
generation_config.json; one no request could ask for stops the daemon at start, naming it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from daemon.model.loader import load_model
from tests.support.systemd import child_env

Checkpoint = Callable[..., tuple[Path, torch.nn.Module]]


def with_generation_config(llama_checkpoint: Checkpoint, tmp_path: Path,
                           **fields: object) -> Path:
    src, _ = llama_checkpoint("none", False)
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 1, "do_sample": True, "max_new_tokens": 100, **fields}))
    return path


def test_generation_config_sets_the_defaults(llama_checkpoint: Checkpoint,
                                             tmp_path: Path) -> None:
    path = with_generation_config(llama_checkpoint, tmp_path, temperature=0.7, top_p=0.8,
                                  top_k=20, repetition_penalty=1.05)
    loaded = load_model(str(path), "cpu", "float32", kernels="torch")
    assert loaded.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                          "repetition_penalty": 1.05}


def test_a_checkpoint_without_them_has_none(llama_checkpoint: Checkpoint) -> None:
    path, _ = llama_checkpoint("none", False)
    loaded = load_model(str(path), "cpu", "float32", kernels="torch")
    assert loaded.generation_defaults == {}


def test_a_default_no_request_could_ask_for_is_refused_naming_it(
        llama_checkpoint: Checkpoint, tmp_path: Path) -> None:
    path = with_generation_config(llama_checkpoint, tmp_path, top_p=0.0)
    proc = subprocess.run(
        [sys.executable, "-m", "tether.cli", "daemon", "--model", str(path), "--runtime-dir",
         str(tmp_path / "run"), "--state-dir", str(tmp_path / "state"), "--log-format", "text"],
        capture_output=True, text=True, timeout=120, check=False, env=child_env())
    assert proc.returncode == 1
    assert "the model's sampling default Expected `float` > 0.0 - at `$.top_p`" in proc.stderr
    assert "Traceback" not in proc.stderr
