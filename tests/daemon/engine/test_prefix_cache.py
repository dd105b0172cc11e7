"""Prefix caching through the whole engine: same output as without it, less prefill, exact
accounting. The fake runner reads every context token back through the block tables, so a
cache hit on the wrong block changes the output; the real builtin:tiny checks the KV itself."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.engine.core import Engine
from daemon.model.loader import load_model
from daemon.model.runner import ModelRunner
from ipc.records import AbortCause, Finish, FinishReason
from ipc.wire import ToProxy
from tests.support.engine_kit import TOK, completion, finishes, make_engine, run, texts

SYSTEM = "You are a careful assistant. Answer briefly and never repeat yourself. " * 2


def test_a_shared_prompt_start_is_computed_once_and_reported():
    engine, runner = make_engine(budget=512)
    engine.submit(completion("a", SYSTEM + "first", temperature=0.0, max_tokens=8))
    first = run(engine)
    engine.submit(completion("b", SYSTEM + "second", temperature=0.0, max_tokens=8))
    second = run(engine)
    shared = len(TOK.encode(SYSTEM))  # BOS + the system text; "first"/"second" differ at once
    cached = shared // 16 * 16
    [prefill] = runner.passes[-8]
    assert (prefill.start_pos, len(prefill.token_ids)) == (cached, shared + 6 - cached)
    assert finishes(second, "b")[0].usage.cached_tokens == cached
    assert finishes(first, "a")[0].usage.cached_tokens == 0
    stats = engine.stats()
    assert stats.prefix_cache_hits == cached
    assert stats.prefix_cache_queries == 2 * shared + 5 + 6
    assert stats.prompt_tokens == shared + 5 + shared + 6 - cached
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_cached > 0
    plain, _ = make_engine(budget=512, prefix_caching=False)
    plain.submit(completion("b", SYSTEM + "second", temperature=0.0, max_tokens=8))
    assert texts(run(plain), "b") == texts(second, "b")


def test_an_aborted_prefill_leaves_its_finished_blocks_reusable():
    engine, runner = make_engine(budget=32)
    engine.submit(completion("gone", SYSTEM, temperature=0.0, max_tokens=8))
    engine.step()  # positions 0-31 written: two full blocks
    engine.abort("gone", AbortCause.CLIENT_DISCONNECT)
    assert engine.block_manager.num_used == 0 and engine.block_manager.num_cached_free == 2
    engine.submit(completion("next", SYSTEM, temperature=0.0, max_tokens=8))
    out = run(engine)
    assert runner.passes[1][0].start_pos == 32
    assert finishes(out, "next")[0].usage.cached_tokens == 32
    plain, _ = make_engine(budget=32, prefix_caching=False)
    plain.submit(completion("next", SYSTEM, temperature=0.0, max_tokens=8))
    assert texts(run(plain), "next") == texts(out, "next")


PREFIXES = ["", SYSTEM, SYSTEM[:40], "zz" * 30]

programs = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(0, len(PREFIXES) - 1), st.integers(0, 40),
              st.integers(1, 3), st.integers(1, 24)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 20)),
), max_size=30)


def play(program: list[tuple], prefix_caching: bool) -> tuple[list[ToProxy], Engine]:
    engine, _ = make_engine(num_blocks=24, max_num_seqs=5, budget=48, max_model_len=400,
                            prefix_caching=prefix_caching)
    out: list[ToProxy] = []
    rids: list[str] = []
    for i, op in enumerate(program):
        if op[0] == "submit":
            rids.append(f"r{i}")
            prompt = PREFIXES[op[1]] + f"q{op[2]}"
            out += engine.submit(completion(f"r{i}", prompt, n=op[3], max_tokens=op[4],
                                            temperature=0.0, ignore_eos=True))
        elif op[0] == "step":
            for _ in range(op[1]):
                out += engine.step()
        elif rids:
            out += engine.abort(rids[op[1] % len(rids)], AbortCause.CLIENT_DISCONNECT)
    out += run(engine, max_ticks=3000)
    assert engine.block_manager.num_used == 0 and engine.sessions == {}
    return out, engine


def completed(out: list[ToProxy]) -> dict[str, dict[int, str]]:
    done = {r.rid for r in out if isinstance(r, Finish) and r.reason is not FinishReason.ABORT}
    return {rid: texts(out, rid) for rid in done}


@settings(max_examples=40, deadline=None)
@given(programs)
def test_caching_never_changes_what_a_request_receives(program):
    cached_out, cached = play(program, prefix_caching=True)
    plain_out, _ = play(program, prefix_caching=False)
    with_cache, without = completed(cached_out), completed(plain_out)
    # Caching changes how many ticks a prefill takes, so aborts may land on different sessions.
    for rid in with_cache.keys() & without.keys():
        assert with_cache[rid] == without[rid], rid
    stats = cached.stats()
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries


# --- the real model -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(2)
    return load_model("builtin:tiny", "cpu", "float32")


def tiny_engine(tiny, num_blocks: int, budget: int, prefix_caching: bool) -> Engine:
    runner = ModelRunner(tiny.model, tiny.config, num_blocks)
    return Engine(runner, tiny.tokenizer, None, 8, budget, tiny.max_model_len, tiny.name,
                  prefix_caching=prefix_caching)


def greedy_rounds(tiny, num_blocks: int, budget: int, prefix_caching: bool
                  ) -> tuple[dict[str, dict[int, str]], Engine]:
    """Two rounds over the same system prompt: the second finds the first's blocks."""
    engine = tiny_engine(tiny, num_blocks, budget, prefix_caching)
    got: dict[str, dict[int, str]] = {}
    for round_ in range(2):
        rids = [f"{round_}-{i}" for i in range(3)]
        for i, rid in enumerate(rids):
            engine.submit(completion(rid, f"{SYSTEM}Question {i}?", n=1 + i % 2,
                                     temperature=0.0, max_tokens=12, ignore_eos=True))
        out = run(engine, max_ticks=2000)
        got |= {rid: texts(out, rid) for rid in rids}
    assert engine.block_manager.num_used == 0
    return got, engine


@pytest.mark.parametrize(("num_blocks", "budget"), [
    (64, 512),  # whole prompts in one pass
    (64, 24),  # chunked prefill: the uncached rest spans several passes
    (14, 64),  # tight: preemption by recompute, which can hit its own blocks
])
def test_builtin_tiny_greedy_output_is_the_same_with_and_without_caching(tiny, num_blocks,
                                                                         budget):
    plain, plain_engine = greedy_rounds(tiny, num_blocks, budget, prefix_caching=False)
    cached, engine = greedy_rounds(tiny, num_blocks, budget, prefix_caching=True)
    assert cached == plain
    assert engine.scheduler.num_cache_hits > 0
    assert engine.figures.num_prompt_tokens < plain_engine.figures.num_prompt_tokens
    if num_blocks == 14:
        assert engine.scheduler.num_preemptions > 0
