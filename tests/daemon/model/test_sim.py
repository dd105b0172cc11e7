"""The simulated model: a runner with no weights under the real engine."""

import time

import pytest

from daemon.engine.core import Engine
from daemon.model.batch import ScheduledChunk
from daemon.model.sim import WORDS, SimRunner, SimSpecError, SimTokenizer, parse_spec
from ipc.records import AbortCause, Delta, RequestKind, SamplingParams, Submit
from ipc.wire import ToProxy
from tests.support.engine_kit import finishes, run, texts

TOK = SimTokenizer()


def sim_engine(tick_ms: float = 0.0, num_blocks: int = 64) -> tuple[Engine, SimRunner]:
    runner = SimRunner(TOK, num_blocks, tick_ms / 1000)
    return Engine(runner, TOK, None, 8, 64, 4096, "sim"), runner


def completion(rid: str, prompt: str = "hello", n: int = 1, **params) -> Submit:
    return Submit(rid, RequestKind.COMPLETION, SamplingParams(**params), n=n,
                  prompts=[prompt], epoch=1)


@pytest.mark.parametrize(("spec", "seconds"), [("sim:0", 0.0), ("sim:20", 0.02),
                                               ("sim:0.5", 0.0005)])
def test_spec_is_the_tick_in_milliseconds(spec, seconds):
    assert parse_spec(spec) == pytest.approx(seconds)


@pytest.mark.parametrize("spec", ["sim:", "sim:fast", "sim:-1", "sim:nan"])
def test_bad_spec_names_the_form(spec):
    with pytest.raises(SimSpecError, match="sim:"):
        parse_spec(spec)


def test_tokenizer_adds_one_id_per_word_to_the_byte_vocabulary():
    first = TOK.first_word_id
    assert TOK.vocab_size == first + len(WORDS)
    assert TOK.encode("hi", add_special_tokens=False) == [104, 105]
    assert TOK.decode([first, 104, first + 1, TOK.eos_token_ids[0]]) == WORDS[0] + "h" + WORDS[1]
    assert TOK.token_bytes(first + 2) == WORDS[2].encode()


def test_every_sequence_gets_one_word_a_tick_with_real_token_counts():
    engine, _ = sim_engine()
    engine.submit(completion("a", n=2, max_tokens=7, temperature=1.0))
    engine.submit(completion("b", "other", max_tokens=5))
    out = run(engine)
    deltas = [r for r in out if isinstance(r, Delta)]
    assert all(t >= TOK.first_word_id for d in deltas for t in d.token_ids)
    for rid, n, tokens in (("a", 2, 7), ("b", 1, 5)):
        fins = finishes(out, rid)
        assert sorted(fins) == list(range(n))
        assert all(f.usage.completion_tokens == tokens for f in fins.values())
        for index, text in texts(out, rid).items():
            ids = [t for d in deltas if d.rid == rid and d.index == index for t in d.token_ids]
            assert len(ids) == tokens and TOK.decode(ids) == text
    # Deterministic: the same prompt gives the same words, sampled or not.
    assert texts(out, "a")[0] == texts(out, "a")[1]
    assert engine.block_manager.num_used == 0 and engine.figures.num_ticks == 7


def test_a_tick_lasts_the_given_milliseconds():
    engine, _ = sim_engine(tick_ms=20)
    engine.submit(completion("a", max_tokens=5))
    t0 = time.monotonic()
    run(engine)
    assert time.monotonic() - t0 >= 5 * 0.02


def test_aborts_and_kv_accounting_are_the_engine_s_own():
    engine, _ = sim_engine(num_blocks=8)
    for i in range(4):
        engine.submit(completion(f"r{i}", "x" * 40, max_tokens=40))
    out: list[ToProxy] = []
    for _ in range(25):
        out += engine.step()
    assert engine.scheduler.num_preemptions > 0  # 4 x 6 blocks do not fit in 8
    out += engine.abort("r0", AbortCause.CLIENT_DISCONNECT)
    out += run(engine)
    assert all(f.usage.completion_tokens == 40 for i in range(1, 4)
               for f in finishes(out, f"r{i}").values())
    assert engine.block_manager.num_used == 0
    assert engine.scheduler.num_cache_hits > 0  # the shared "x" prompt


def test_a_block_table_too_short_for_the_chunk_is_refused():
    runner = SimRunner(TOK, 8, 0.0)
    with pytest.raises(ValueError, match="block_table"):
        runner.run([ScheduledChunk([1] * 17, 0, [0], True)])
