"""Rank 0's runner when there are several ranks: it sends each batch, then runs its own shard.

The engine cannot tell it from the plain ModelRunner: it calls `run` and `copy_block` as ever.
Sampling happens on rank 0 alone, from the logits gathered there, so every rank agrees on the
tokens; an aborted session is simply absent from the next batch.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import Tensor

from daemon.model.batch import ScheduledChunk
from daemon.model.parallel.codec import INIT, REPORT, RankFigures, encode_run
from daemon.model.parallel.group import Ranks, StartError
from daemon.model.runner import ModelRunner


class RanksLost(RuntimeError):
    """A rank died, hung or broke the group; the daemon cannot go on."""


class DriverRunner:
    """Rank 0's runner when there are several ranks (the engine's Runner)."""

    def __init__(self, runner: ModelRunner, ranks: Ranks) -> None:
        self.runner = runner
        self.ranks = ranks
        self.block_size = runner.block_size
        self.num_blocks = runner.num_blocks
        self.figures = RankFigures(0)
        self._copies: list[tuple[int, int]] = []

    def start(self) -> None:
        """Give the other ranks the cache size and wait until each has its runner."""
        try:
            self.ranks.group.send(torch.tensor([INIT, self.num_blocks], dtype=torch.long))
            self.ranks.group.gather_object(None)
        except Exception as e:
            raise StartError(self.ranks.exited(wait_s=1.0) or f"tensor-parallel ranks: {e}") from e

    def run(self, chunks: list[ScheduledChunk]) -> Tensor:
        if not chunks:
            return self.runner.run(chunks)
        self.runner.check(chunks)  # a bad batch is refused here, before any other rank sees it
        try:
            t0 = time.perf_counter()
            self.ranks.group.send(encode_run(chunks, self._copies))
            self.figures.send_s += time.perf_counter() - t0
            self._copies = []
            logits = self.runner.run(chunks)
        except Exception as e:
            reason = self.ranks.failure or self.ranks.exited(wait_s=1.0) or (
                f"tensor-parallel forward pass failed: {type(e).__name__}: {e}")
            self.ranks.lost(reason)
            raise RanksLost(reason) from e
        self.figures.ran(chunks, self.ranks.group)
        return logits

    def copy_block(self, src: int, dst: int) -> None:
        self.runner.copy_block(src, dst)
        self._copies.append((src, dst))

    def report(self) -> list[RankFigures]:
        """Every rank's own figures, rank 0 first."""
        self.ranks.group.send(torch.tensor([REPORT], dtype=torch.long))
        others = self.ranks.group.gather_object(None) or []
        return [dataclasses.replace(self.figures),
                *(f for f in others[1:] if isinstance(f, RankFigures))]
