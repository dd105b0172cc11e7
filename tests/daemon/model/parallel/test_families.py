"""Tensor parallelism of the families beside Llama (gloo, two processes, as test_runner.py):
each rank reads its slices of every tensor (Phi-3's fused qkv_proj and gate_up_proj cut per
part), and greedy tokens through the real engine (chunked prefill, preemption, n > 1) equal
one process running the whole model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from daemon.model.loader import LoadedModel, load_model
from daemon.model.parallel.driver import DriverRunner
from daemon.model.parallel.group import TPGroup
from daemon.model.parallel.load import load_runner
from daemon.model.runner import ModelRunner, ScheduledChunk
from tests.daemon.model.parallel.test_layers import _whole
from tests.support.checkpoints import FAMILIES
from tests.support.greedy import PROMPTS, greedy
from tests.support.options import model_options

pytestmark = pytest.mark.timeout(300)

Family = Callable[[str], tuple[Path, torch.nn.Module]]
NUM_BLOCKS = 12  # few enough that the scenario preempts
BUDGET = 24


@pytest.mark.parametrize("name", list(FAMILIES))
def test_shards_put_back_together_are_the_checkpoint(family: Family, name: str) -> None:
    path, _ = family(name)
    whole = load_model(str(path), "cpu", torch.float32, kernels="torch").model
    shards = [load_model(str(path), "cpu", torch.float32, group=TPGroup(r, 2)).model
              for r in range(2)]
    for param_name, param in whole.named_parameters():
        assert torch.equal(_whole(shards, param_name), param), param_name


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request: pytest.FixtureRequest, family: Family
         ) -> Iterator[tuple[DriverRunner, LoadedModel, ModelRunner]]:
    """(TP=2 runner, its rank-0 model, a TP=1 runner of the same checkpoint)."""
    path, _ = family(request.param)
    threads = torch.get_num_threads()
    options = model_options(model=str(path), device="cpu", dtype="float32", threads=2,
                            tensor_parallel_size=2, kv_cache_blocks=NUM_BLOCKS,
                            log_format="text")
    loaded, driver, ranks = load_runner(options)
    assert isinstance(driver, DriverRunner) and ranks is not None
    try:
        whole = load_model(str(path), "cpu", torch.float32)
        yield driver, loaded, ModelRunner(whole.model, whole.config, NUM_BLOCKS)
    finally:
        ranks.close()
        torch.set_num_threads(threads)


def test_greedy_tokens_match_one_process(pair: tuple[DriverRunner, LoadedModel, ModelRunner]
                                         ) -> None:
    driver, loaded, whole = pair
    expected, one = greedy(whole, loaded, PROMPTS, 32, BUDGET)
    got, _ = greedy(driver, loaded, PROMPTS, 32, BUDGET)
    assert one.scheduler.num_preemptions > 0
    assert got == expected and len(got) == 5


def test_logits_past_the_window_match_one_process(
        pair: tuple[DriverRunner, LoadedModel, ModelRunner]) -> None:
    driver, _, whole = pair
    prefill = [ScheduledChunk(list(range(5, 45)), 0, [0, 1, 2], True),
               ScheduledChunk(list(range(100, 120)), 0, [3, 4], True)]
    mixed = [ScheduledChunk([7], 40, [0, 1, 2], True),
             ScheduledChunk(list(range(50, 60)), 20, [3, 4], True)]
    for chunks in (prefill, mixed):
        expected, got = whole.run(chunks), driver.run(chunks)
        assert (got - expected).abs().max() <= 1e-4
