"""The process group's lifecycle where it can fail before any model is loaded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from daemon.model.parallel.group import StartError, start, threads_per_rank


def test_a_rank_that_dies_before_joining_is_named() -> None:
    def spawn(rank: int, port: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])

    with pytest.raises(StartError, match=r"rank 1 \(pid \d+\) exited with status 3 before "
                                         "joining"):
        start(2, "cpu", spawn)


def test_too_few_gpus_are_refused_before_anything_starts() -> None:
    def spawn(rank: int, port: int) -> subprocess.Popen[bytes]:
        raise AssertionError("nothing may be spawned")

    import torch

    if torch.cuda.device_count() >= 64:
        pytest.skip("this machine has 64 GPUs")
    with pytest.raises(StartError, match="--tensor-parallel-size 64 needs 64 GPUs"):
        start(64, "cuda", spawn)


def test_threads_are_shared_out_between_ranks() -> None:
    assert threads_per_rank(4, 2) == 2
    assert threads_per_rank(1, 2) == 1  # never none
    assert threads_per_rank(0, 1) == max(1, (os.cpu_count() or 1) - 1)
