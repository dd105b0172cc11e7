"""Sequences and a scheduler over a real block manager, for the scheduler's tests."""

from daemon.engine.batch import Batch
from daemon.engine.block_manager import BlockManager
from daemon.engine.scheduler import Scheduler
from daemon.engine.sequence import Sequence
from daemon.model.tokenizer import ByteTokenizer
from ipc.records import SamplingParams

TOK = ByteTokenizer()


def seq(prompt_len: int, n: int = 1, rid: str = "r") -> Sequence:
    ids = [97 + i % 26 for i in range(prompt_len)]
    group = [Sequence(rid, i, list(ids), SamplingParams()) for i in range(n)]
    group[0].fork_children = group[1:]
    return group[0]


def scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64,
              copies: list[tuple[int, int]] | None = None) -> Scheduler:
    sink = copies if copies is not None else []
    return Scheduler(BlockManager(num_blocks), max_num_seqs, budget,
                     lambda s, d: sink.append((s, d)))


def run_tick(sched: Scheduler, token: int = 1) -> Batch:
    """One tick with a model that always samples `token`."""
    batch = sched.schedule()
    sched.update(batch)
    for s in batch.sampled:
        s.token_ids.append(token)
    return batch
