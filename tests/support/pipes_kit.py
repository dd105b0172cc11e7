"""Records and a reader for the pipe tests (tests/ipc/test_pipes*.py)."""

from __future__ import annotations

import multiprocessing
import time

from ipc.pipes import DaemonPipes
from ipc.records import RequestKind, SamplingParams, Submit
from ipc.wire import ToDaemon

FORK = multiprocessing.get_context("fork")


def submit(rid: str, prompt: str = "hello") -> Submit:
    return Submit(rid=rid, epoch=7, kind=RequestKind.COMPLETION, sampling=SamplingParams(),
                  prompts=[prompt])


def drain(pipes: DaemonPipes, until: float, want: int) -> list[ToDaemon]:
    got: list[ToDaemon] = []
    while time.monotonic() < until and len(got) < want:
        pipes.wait_readable(0.05)
        got += pipes.read_control()
        got += pipes.read_requests()
    return got
