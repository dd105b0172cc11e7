"""Tensor parallelism on real processes (gloo on the CPU): this test process is rank 0, started
by the daemon's own `load_runner`, and rank 1 is a spawned `python -m daemon.model.parallel.rank`.

Everything is compared with one process running the whole model: logits, and greedy tokens
through the real engine with chunked prefill, preemption and n > 1 (forked sequences, so
copy-on-write block copies reach rank 1 too). tests/gpu/tp_check.py runs this module on GPUs
with NCCL (TETHER_TP_TEST_DEVICE=cuda, TETHER_TP_TEST_SIZE=N).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from daemon.engine.core import Engine
from daemon.model.batch import ScheduledChunk
from daemon.model.loader import LoadedModel, load_model
from daemon.model.parallel.codec import decode_run, encode_run
from daemon.model.parallel.driver import DriverRunner
from daemon.model.parallel.load import load_runner
from daemon.model.runner import ModelRunner
from ipc.records import AbortCause
from tests.support.checkpoints import write_tokenizer
from tests.support.greedy import PROMPTS, completion, greedy
from tests.support.options import model_options

pytestmark = pytest.mark.timeout(300)

DEVICE = os.environ.get("TETHER_TP_TEST_DEVICE", "cpu")
SIZE = int(os.environ.get("TETHER_TP_TEST_SIZE", "2"))
NUM_BLOCKS = 12  # few enough that the scenario below preempts
BUDGET = 24  # tokens per tick: prompts of ~40 tokens are prefilled in chunks


def write_checkpoint(path: Path) -> None:
    """A Llama whose shapes exercise the edges: one KV head (replicated on both ranks), an odd
    vocabulary (padded on rank 1), an untied head; attention peaked, so errors show."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                      max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0,
                      eos_token_id=1, initializer_range=0.2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    write_tokenizer(path)


@pytest.fixture(scope="module", params=["builtin:tiny", "hf"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[DriverRunner, LoadedModel, ModelRunner]]:
    """(TP=SIZE runner, its rank-0 model, a TP=1 runner of the same model and cache size)."""
    spec = request.param
    if spec == "hf":
        path = tmp_path_factory.mktemp("tp-llama")
        write_checkpoint(path)
        spec = str(path)
    threads = torch.get_num_threads()
    options = model_options(model=spec, device=DEVICE, dtype="float32", threads=2,
                            tensor_parallel_size=SIZE, kv_cache_blocks=NUM_BLOCKS,
                            log_format="text")
    loaded, driver, ranks = load_runner(options)
    assert isinstance(driver, DriverRunner) and ranks is not None
    try:
        whole = load_model(spec, driver.runner.device, torch.float32)
        yield driver, loaded, ModelRunner(whole.model, whole.config, NUM_BLOCKS)
    finally:
        ranks.close()
        torch.set_num_threads(threads)
    assert [p.returncode for p in ranks.procs] == [0] * (SIZE - 1)  # told to stop, they left


def test_batch_survives_the_wire() -> None:
    chunks = [ScheduledChunk([5, 6, 7], 0, [3, 4], False), ScheduledChunk([9], 40, [1, 2, 0], True)]
    assert decode_run(encode_run(chunks, [(1, 8)])) == (chunks, [(1, 8)])


def test_logits_match_one_process(pair: tuple[DriverRunner, LoadedModel, ModelRunner]) -> None:
    driver, _, whole = pair
    prefill = [ScheduledChunk(list(range(5, 45)), 0, [0, 1, 2], True),
               ScheduledChunk(list(range(100, 120)), 0, [3, 4], True)]
    # Decodes of those two next to chunks continuing a cached prefix.
    mixed = [ScheduledChunk([7], 40, [0, 1, 2], True), ScheduledChunk([9], 20, [3, 4], True),
             ScheduledChunk(list(range(50, 60)), 10, [5, 8], False),
             ScheduledChunk([11, 12], 20, [6, 7], True)]
    for chunks in (prefill, mixed):
        expected, got = whole.run(chunks), driver.run(chunks)
        assert got.shape == expected.shape
        assert (got - expected).abs().max() <= 1e-4


def test_a_batch_larger_than_one_broadcast_arrives_whole(
        pair: tuple[DriverRunner, LoadedModel, ModelRunner]) -> None:
    driver, _, whole = pair
    blocks = list(range(10))
    prefill = [ScheduledChunk(list(range(2, 162)), 0, blocks, False)]
    assert whole.run(prefill).shape[0] == driver.run(prefill).shape[0] == 0
    # 150 decodes with 10-block tables: ~2,250 integers, more than the first broadcast holds.
    decodes = [ScheduledChunk([7 + i], i, blocks, True) for i in range(150)]
    expected, got = whole.run(decodes), driver.run(decodes)
    assert got.shape == expected.shape == (150, expected.shape[1])
    assert (got - expected).abs().max() <= 1e-4


def test_greedy_tokens_match_one_process(pair: tuple[DriverRunner, LoadedModel, ModelRunner]
                                         ) -> None:
    driver, loaded, whole = pair
    expected, one = greedy(whole, loaded, PROMPTS[:3], 24, BUDGET)
    got, two = greedy(driver, loaded, PROMPTS[:3], 24, BUDGET)
    assert one.scheduler.num_preemptions > 0  # the scenario does preempt
    assert got == expected
    assert len(got) == 4 and all(len(t) == 24 for t in got.values())
    assert two.figures.num_ticks == one.figures.num_ticks and two.block_manager.num_used == 0
    figures = driver.report()
    assert len({f.num_runs for f in figures}) == 1  # every rank ran every forward pass


def test_abort_leaves_both_ranks_in_the_same_tick(
        pair: tuple[DriverRunner, LoadedModel, ModelRunner]) -> None:
    driver, loaded, _ = pair
    engine = Engine(driver, loaded.tokenizer, None, 8, BUDGET, loaded.max_model_len, loaded.name)
    engine.submit(completion("keep", "hello world", max_tokens=64))
    engine.submit(completion("gone", "the quick brown fox", max_tokens=64))
    for _ in range(3):
        engine.step()
    kept = set(engine.sessions["keep"].sequences[0].block_table)
    dropped = set(engine.sessions["gone"].sequences[0].block_table)
    before = [f.num_runs for f in driver.report()]
    engine.abort("gone", AbortCause.CLIENT_DISCONNECT)
    assert engine.block_manager.num_used == len(kept)  # its blocks are free at once
    engine.step()
    figures = driver.report()
    assert [f.num_runs for f in figures] == [n + 1 for n in before]
    for f in figures:  # the next forward pass, on either rank, reads none of its blocks
        assert set(f.last_block_ids) == kept and not kept & dropped
    engine.abort("keep", AbortCause.CLIENT_DISCONNECT)
    assert engine.block_manager.num_used == 0 and not engine.has_work
