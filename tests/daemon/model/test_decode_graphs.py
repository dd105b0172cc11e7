"""Decode ticks through the padded bucket buffers (daemon/model/decode_graphs.py), run eagerly on CPU:
the same logits as the plain path, padding rows that write only the scratch block, and the
dispatch between the two paths. CUDA capture and replay run in tests/gpu/gpu_check.py."""

from __future__ import annotations

import random

import pytest
import torch

from daemon.model.decode_graphs import buckets_for
from daemon.model.loader import LoadedModel, load_model
from daemon.model.runner import ModelRunner, ScheduledChunk
from tests.support.engine_kit import completion
from tests.support.engine_kit import run as run_engine

BS = 16
NUM_BLOCKS = 48


@pytest.fixture(scope="module", params=["auto", "torch"])
def tiny(request: pytest.FixtureRequest) -> LoadedModel:
    return load_model("builtin:tiny", "cpu", torch.float32, kernels=request.param)


def runners(loaded: LoadedModel, max_batch: int = 8) -> tuple[ModelRunner, ModelRunner]:
    plain = ModelRunner(loaded.model, loaded.config, NUM_BLOCKS)
    padded = ModelRunner(loaded.model, loaded.config, NUM_BLOCKS, graph_max_batch=max_batch)
    return plain, padded


def prefill_both(plain: ModelRunner, padded: ModelRunner, lengths: list[int],
                 seed: int = 0) -> list[ScheduledChunk]:
    """Prompts prefilled into both caches (scattered blocks); their next decode chunks."""
    rng = random.Random(seed)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    decodes = []
    for n in lengths:
        table = [free.pop() for _ in range(-(-(n + 2) // BS))]  # room for two decodes
        ids = [rng.randrange(1, 256) for _ in range(n)]
        for runner in (plain, padded):
            runner.run([ScheduledChunk(ids, 0, table, True)])
        decodes.append(ScheduledChunk([rng.randrange(1, 256)], n, table, True))
    return decodes


def test_buckets_are_powers_of_two_up_to_the_limit() -> None:
    assert buckets_for(1) == [1]
    assert buckets_for(8) == [1, 2, 4, 8]
    assert buckets_for(48) == [1, 2, 4, 8, 16, 32, 48]


def test_padded_decode_matches_the_plain_path(tiny: LoadedModel) -> None:
    plain, padded = runners(tiny)
    decodes = prefill_both(plain, padded, [3, 16, 31, 70, 5])  # bucket 8: 3 padding rows
    want, got = plain.run(decodes), padded.run(decodes)
    assert padded.num_static_ticks == 1 and plain.num_static_ticks == 0
    assert got.shape == want.shape == (5, tiny.config.vocab_size)
    assert (got - want).abs().max() < 1e-4
    # The next token too (the 31-token context moves into its third block).
    step = [ScheduledChunk([7], c.start_pos + 1, c.block_table, True) for c in decodes]
    assert (padded.run(step) - plain.run(step)).abs().max() < 1e-4


def test_padding_rows_write_only_the_scratch_block(tiny: LoadedModel) -> None:
    _, padded = runners(tiny)
    gen = torch.Generator().manual_seed(0)
    for cache in padded.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    before = [c.clone() for c in padded.kv_caches]
    chunks = [ScheduledChunk([9], 20, [4, 11], True), ScheduledChunk([8], 3, [30], True),
              ScheduledChunk([7], 0, [2], True)]  # bucket 4: one padding row
    padded.run(chunks)
    scratch = padded.kv_caches[0].shape[1] - 1
    assert scratch == NUM_BLOCKS
    written = {(11, 4), (30, 3), (2, 0)}  # (block, offset) of each new token
    for old, new in zip(before, padded.kv_caches, strict=True):
        changed = (old != new).any(dim=(0, 2, 4)).nonzero().tolist()  # [block, offset]
        real = {(b, o) for b, o in changed if b != scratch}
        assert real == written
        assert (new[:, scratch] != old[:, scratch]).any()


def test_mixed_and_oversized_ticks_run_eagerly(tiny: LoadedModel) -> None:
    plain, padded = runners(tiny, max_batch=2)
    decodes = prefill_both(plain, padded, [4, 9, 12])
    assert padded.num_eager_ticks == 3  # the prefills
    padded.run(decodes)  # 3 rows: over the largest bucket (2)
    padded.run([*decodes[:2], ScheduledChunk([1, 2], 0, [47], True)])  # mixed
    assert (padded.num_static_ticks, padded.num_eager_ticks) == (0, 5)
    padded.run(decodes[:2])
    assert padded.num_static_ticks == 1


def test_rows_without_logits_are_left_out(tiny: LoadedModel) -> None:
    plain, padded = runners(tiny)
    decodes = prefill_both(plain, padded, [6, 20, 33])
    decodes[1].needs_logits = False  # e.g. a prompt's last token in a chunk of its own
    want, got = plain.run(decodes), padded.run(decodes)
    assert got.shape[0] == 2 and (got - want).abs().max() < 1e-4


def test_capture_needs_cuda(tiny: LoadedModel) -> None:
    _, padded = runners(tiny)
    with pytest.raises(ValueError, match="CUDA"):
        padded.capture()


def test_engine_tokens_are_the_same_through_the_buckets(tiny: LoadedModel) -> None:
    """Greedy through the real engine, with chunked prefill, n > 1 and preemption (a cache
    too small for every sequence at once): the same tokens on both paths."""
    from daemon.engine.core import Engine
    from daemon.model.tokenizer import ByteTokenizer
    from ipc.records import Delta

    outputs = []
    for graph_max_batch in (0, 8):
        runner = ModelRunner(tiny.model, tiny.config, 14, graph_max_batch=graph_max_batch)
        engine = Engine(runner, ByteTokenizer(), None, 8, 32, 512, "tiny")
        prompts = ["the quick brown fox " * 3, "hello", "x" * 70, "abc " * 9]
        for i, prompt in enumerate(prompts):
            engine.submit(completion(f"r{i}", prompt, n=2 if i == 1 else 1, max_tokens=40,
                                     temperature=0.0, ignore_eos=True))
        records = run_engine(engine, max_ticks=2000)
        assert engine.scheduler.num_preemptions > 0
        tokens: dict[tuple[str, int], list[int]] = {}
        for r in records:
            if isinstance(r, Delta):
                tokens.setdefault((r.rid, r.index), []).extend(r.token_ids)
        assert all(len(t) == 40 for t in tokens.values()) and len(tokens) == 5
        outputs.append((tokens, runner.num_static_ticks))
    assert outputs[0][0] == outputs[1][0]
    assert outputs[0][1] == 0 and outputs[1][1] > 0


@pytest.mark.parametrize("max_batch", [0, 8])
def test_a_tick_builds_its_metadata_as_one_tensor(tiny: LoadedModel, max_batch: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One host tensor per tick, so one copy to the device: decodes, a chunk continuing a
    prompt and a fresh prompt in one eager tick, then a decode-only tick."""
    runner = ModelRunner(tiny.model, tiny.config, NUM_BLOCKS, graph_max_batch=max_batch)
    runner.run([ScheduledChunk(list(range(1, 21)), 0, [3, 4], True),
                ScheduledChunk(list(range(1, 9)), 0, [5], False)])
    made: list[tuple[int, ...]] = []
    real = torch.tensor

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        made.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "tensor", counted)
    runner.run([ScheduledChunk([7], 20, [3, 4], True), ScheduledChunk([1, 2, 3], 8, [5], True),
                ScheduledChunk([9, 8, 7, 6], 0, [6], True)])
    runner.run([ScheduledChunk([7], 21, [3, 4], True), ScheduledChunk([5], 11, [5], True)])
    assert len(made) == 2


def test_a_drafted_chunk_runs_as_decodes_with_the_logits_of_one_at_a_time(
        tiny: LoadedModel) -> None:
    """A speculative decode ([last token] + drafts, a row each) gives the logits that decoding
    those tokens one pass at a time gives, and through the padded buckets (the decode path)."""
    plain, padded = runners(tiny)
    (decode,) = prefill_both(plain, padded, [21])
    tokens = [decode.token_ids[0], 7, 8, 9]
    table = [*decode.block_table, NUM_BLOCKS - 1]  # room for the drafts past its blocks
    one_at_a_time = torch.cat([plain.run([ScheduledChunk([t], 21 + j, table, True)])
                               for j, t in enumerate(tokens)])
    drafted = padded.run([ScheduledChunk(tokens, 21, table, True, all_logits=True, drafted=True)])
    assert drafted.shape == one_at_a_time.shape
    assert (drafted - one_at_a_time).abs().max() < 1e-4
    assert padded.num_static_ticks == 1
