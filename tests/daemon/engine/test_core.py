import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.engine.core import Engine
from daemon.engine.figures import LOGGED_TICKS
from daemon.model.loader import load_model
from daemon.model.runner import ModelRunner
from ipc.reasons import Reason
from ipc.records import (
    AbortCause,
    Admitted,
    Delta,
    Error,
    Finish,
    FinishReason,
    Message,
    RequestKind,
    SamplingParams,
    Submit,
)
from ipc.wire import ToProxy
from tests.support.engine_kit import (
    EOS,
    TOK,
    completion,
    finishes,
    make_engine,
    run,
    texts,
)
from tests.support.fake_runner import Script


def writer(text: str, prompt: str) -> Script:
    n_prompt = len(TOK.encode(prompt))
    data = text.encode()
    return lambda ctx: data[len(ctx) - n_prompt] if len(ctx) - n_prompt < len(data) else EOS


def test_completion_streams_text_and_finishes_with_usage():
    engine, _ = make_engine(writer("Hi there", "hello"))
    assert engine.submit(completion("a", temperature=0.0, max_tokens=50)) == [Admitted("a")]
    out = run(engine)
    assert texts(out, "a") == {0: "Hi there"}
    fin = finishes(out, "a")[0]
    assert fin.reason is FinishReason.STOP
    assert (fin.usage.prompt_tokens, fin.usage.completion_tokens) == (6, 9)
    assert engine.block_manager.num_used == 0 and engine.sessions == {}


def test_max_tokens_finishes_with_length():
    engine, _ = make_engine(writer("abcdefgh", "hello"))
    engine.submit(completion("a", temperature=0.0, max_tokens=3))
    out = run(engine)
    assert texts(out, "a") == {0: "abc"}
    assert finishes(out, "a")[0].reason is FinishReason.LENGTH


def test_stop_string_spanning_tokens_is_never_sent():
    engine, _ = make_engine(writer("one two. three", "hello"))
    engine.submit(completion("a", temperature=0.0, max_tokens=50, stop=["o. t"]))
    out = run(engine)
    assert texts(out, "a") == {0: "one tw"}
    assert finishes(out, "a")[0].reason is FinishReason.STOP


def test_stop_token_id_ends_without_its_text():
    engine, _ = make_engine(writer("abc;def", "hello"))
    engine.submit(completion("a", temperature=0.0, max_tokens=50, stop_token_ids=[ord(";")]))
    out = run(engine)
    assert texts(out, "a") == {0: "abc"}
    assert finishes(out, "a")[0].usage.completion_tokens == 4


def test_n_samples_share_the_prompt_and_match_separate_runs():
    prompt = "a prompt of twenty b"  # 21 tokens with BOS: one full block plus a partial one
    engine, runner = make_engine()
    engine.submit(completion("a", prompt, n=3, temperature=1.0, seed=7, max_tokens=12,
                             ignore_eos=True))
    out = run(engine)
    prefill = runner.passes[0]
    assert len(prefill) == 1 and len(prefill[0].token_ids) == 21
    assert len(runner.copies) == 2
    got = texts(out, "a")
    assert len(set(got.values())) > 1
    # The same request again, next to other work, gives the same choices.
    again, _ = make_engine()
    again.submit(completion("x", "unrelated", n=2, temperature=1.0, max_tokens=12))
    again.submit(completion("b", prompt, n=3, temperature=1.0, seed=7, max_tokens=12,
                            ignore_eos=True))
    assert texts(run(again), "b") == got


def test_preemption_under_memory_pressure_gives_the_same_text():
    def greedy_texts(num_blocks: int) -> tuple[dict[str, dict[int, str]], int]:
        engine, _ = make_engine(num_blocks=num_blocks, budget=64)
        for i in range(6):
            engine.submit(completion(f"r{i}", f"prompt number {i}", n=2, temperature=0.0,
                                     max_tokens=40, ignore_eos=True))
        out = run(engine, max_ticks=5000)
        assert engine.block_manager.num_used == 0
        return {f"r{i}": texts(out, f"r{i}") for i in range(6)}, engine.scheduler.num_preemptions

    roomy, roomy_preemptions = greedy_texts(64)
    tight, tight_preemptions = greedy_texts(8)
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy


def test_seeded_output_does_not_depend_on_batch_neighbours():
    def seeded_text(neighbours: int) -> str:
        engine, _ = make_engine()
        for i in range(neighbours):
            engine.submit(completion(f"n{i}", f"other {i}", temperature=1.0, max_tokens=20))
        engine.submit(completion("s", temperature=0.8, top_p=0.9, seed=42, max_tokens=20,
                                 ignore_eos=True))
        return texts(run(engine), "s")[0]

    assert seeded_text(0) == seeded_text(3) == seeded_text(6)


def test_abort_while_waiting_is_never_prefilled():
    engine, runner = make_engine(max_num_seqs=1)
    engine.submit(completion("a", max_tokens=5))
    engine.submit(completion("b", max_tokens=5))
    engine.step()
    out = engine.abort("b", AbortCause.CLIENT_DISCONNECT, t_disconnect=engine.clock())
    assert out == [Finish("b", 0, FinishReason.ABORT, out[0].usage,
                          cause=AbortCause.CLIENT_DISCONNECT)]
    run(engine)
    assert all("b" not in t.rids for t in engine.figures.tick_log)
    assert len(runner.passes) == len(engine.figures.tick_log)


def test_no_forward_pass_after_the_abort_includes_the_session():
    engine, _ = make_engine()
    engine.submit(completion("a", max_tokens=100, ignore_eos=True))
    engine.submit(completion("b", max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    t_read = engine.clock()
    engine.abort("a", AbortCause.CLIENT_DISCONNECT, t_disconnect=t_read - 0.5, t_read=t_read)
    run(engine)
    assert all("a" not in t.rids for t in engine.figures.tick_log if t.start > t_read)
    assert engine.block_manager.num_used == 0


def test_abort_is_idempotent():
    engine, _ = make_engine()
    engine.submit(completion("a", n=2, max_tokens=100, ignore_eos=True))
    engine.step()
    first = engine.abort("a", AbortCause.CLIENT_DISCONNECT)
    assert sorted(r.index for r in first) == [0, 1]
    assert engine.abort("a", AbortCause.CLIENT_DISCONNECT) == []
    assert engine.stats().aborts == {"client_disconnect": 1}
    assert engine.block_manager.num_used == 0 and not engine.has_work


def test_abort_before_submit_leaves_a_tombstone_used_once_and_counted():
    engine, runner = make_engine()
    assert engine.abort("ghost", AbortCause.CLIENT_DISCONNECT, t_disconnect=99.0) == []
    out = engine.submit(completion("ghost", n=2))
    assert [(r.index, r.reason, r.cause) for r in out] == [
        (0, FinishReason.ABORT, AbortCause.CLIENT_DISCONNECT),
        (1, FinishReason.ABORT, AbortCause.CLIENT_DISCONNECT)]
    assert not engine.has_work and runner.passes == []
    stats = engine.stats()
    assert stats.aborts == {"client_disconnect": 1} and stats.finished == {"abort": 1}
    assert len(stats.abort_latency_obs) == 1 and stats.abort_latency_ticks_obs == [0]
    # Consumed: the same key again is a new request (keys are unique; this is the backstop).
    assert engine.submit(completion("ghost")) == [Admitted("ghost")]


def test_a_paused_session_keeps_its_blocks_and_is_not_scheduled():
    engine, _ = make_engine()
    engine.submit(completion("p", max_tokens=100, ignore_eos=True))
    engine.submit(completion("q", max_tokens=100, ignore_eos=True))
    engine.step()
    blocks = engine.block_manager.num_used
    engine.set_paused("p", True)
    engine.set_paused("q", True)
    assert not engine.has_work and engine.stats().paused == 2
    assert engine.block_manager.num_used == blocks
    engine.set_paused("q", False)
    generated = {rid: engine.sessions[rid].num_generated for rid in ("p", "q")}
    engine.step()
    assert engine.sessions["p"].num_generated == generated["p"]
    assert engine.sessions["q"].num_generated == generated["q"] + 1
    engine.set_paused("p", False)
    assert engine.stats().paused == 0 and engine.has_work
    engine.step()
    assert engine.sessions["p"].num_generated == generated["p"] + 1


def test_a_one_token_prefill_chunk_counts_as_prefill():
    engine, _ = make_engine(budget=8)
    engine.submit(completion("a", "x" * 8, max_tokens=1))  # BOS + 8: chunks of 8 and 1
    run(engine)
    assert engine.stats().prompt_tokens == 9


def test_tokens_after_disconnect_counts_ticks_started_after_it():
    engine, _ = make_engine()
    engine.submit(completion("a", max_tokens=100, ignore_eos=True))
    engine.step()
    t_disconnect = engine.clock()
    for _ in range(4):
        engine.step()
    engine.abort("a", AbortCause.CLIENT_DISCONNECT, t_disconnect=t_disconnect)
    stats = engine.stats()
    assert stats.tokens_after_disconnect == 4
    assert stats.abort_latency_ticks_obs == [4]
    assert len(stats.abort_latency_obs) == 1 and stats.abort_latency_obs[0] > 0
    assert engine.stats().abort_latency_obs == []  # observations are handed out once


@pytest.mark.parametrize(("submit", "param", "reason"), [
    (completion("a", "x" * 500, max_tokens=20), "max_tokens", Reason.CONTEXT_LENGTH_EXCEEDED),
    (completion("a", "", max_tokens=20), "prompt", Reason.INVALID),
    (completion("a", n=9), "n", Reason.INVALID),
    (completion("a", stop_token_ids=[10**6], min_tokens=2), "stop_token_ids", Reason.INVALID),
    (Submit("a", RequestKind.CHAT, SamplingParams(), epoch=1), "messages", Reason.INVALID),
])
def test_invalid_requests_are_rejected_naming_the_field(submit, param, reason):
    engine, _runner = make_engine()
    [err] = engine.submit(submit)
    assert isinstance(err, Error) and err.rid == "a"
    assert (err.param, err.reason) == (param, reason)
    assert not engine.has_work


def test_context_length_error_names_the_limit():
    engine, _ = make_engine()
    [err] = engine.submit(completion("a", "x" * 500, max_tokens=20))
    assert isinstance(err, Error) and "512" in err.message and "max_tokens" in err.message


def test_chat_renders_the_template():
    engine, runner = make_engine()
    engine.submit(Submit("c", RequestKind.CHAT, SamplingParams(max_tokens=2),
                         messages=[Message("user", "hi")], epoch=1))
    run(engine)
    prompt = runner.passes[0][0].token_ids
    assert TOK.decode(prompt) == "user\nhi\nassistant\n"
    assert prompt[0] == TOK.special_ids["<bos>"] and prompt.count(prompt[0]) == 1


def test_abort_epoch_older_than_spares_the_new_proxy():
    engine, _ = make_engine()
    engine.submit(Submit("old", RequestKind.COMPLETION, SamplingParams(), prompts=["x"], epoch=1))
    engine.submit(Submit("new", RequestKind.COMPLETION, SamplingParams(), prompts=["y"], epoch=2))
    out = engine.abort_epoch_older_than(2, AbortCause.PROXY_LOST)
    assert [r.rid for r in out] == ["old"] and engine.is_running("new")


def test_request_end_is_logged_with_fields(caplog):
    engine, _ = make_engine(writer("ok", "hello"))
    with caplog.at_level(logging.INFO, logger="tether.requests"):
        engine.submit(completion("a", temperature=0.0))
        run(engine)
    [rec] = [r for r in caplog.records if r.name == "tether.requests"]
    fields = rec.fields  # type: ignore[attr-defined]
    assert fields["rid"] == "a" and fields["finish_reason"] == "stop"
    assert fields["prompt_tokens"] == 6 and fields["generated_tokens"] == 3
    assert fields["duration_s"] > 0


def test_an_aborted_request_logs_its_eviction_time_and_last_ticks(caplog):
    engine, _ = make_engine()
    engine.submit(completion("a", max_tokens=100, ignore_eos=True, n=2))
    for _ in range(6):
        engine.step()
    starts = list(engine.sessions["a"].ticks.starts)
    with caplog.at_level(logging.INFO, logger="tether.requests"):
        engine.abort("a", AbortCause.CLIENT_DISCONNECT, t_disconnect=starts[-2] + 0.0001)
    [rec] = [r for r in caplog.records if r.name == "tether.requests"]
    fields = rec.fields  # type: ignore[attr-defined]
    assert fields["cause"] == "client_disconnect" and fields["evicted_at"] > starts[-1]
    # The newest ticks, oldest first: enough to count the tokens sampled after any time in them.
    assert [t for t, _ in fields["last_ticks"]] == pytest.approx(starts[-LOGGED_TICKS:])
    assert [n for _, n in fields["last_ticks"]] == [2] * LOGGED_TICKS
    assert fields["ticks_after_disconnect"] == 1 and fields["tokens_after_disconnect"] == 2


def test_stats_report_gauges_and_counters():
    engine, _ = make_engine(writer("ok", "hello"))
    engine.submit(completion("a", temperature=0.0))
    engine.step()
    s = engine.stats()
    assert (s.running, s.waiting, s.ticks, s.prompt_tokens) == (1, 0, 1, 6)
    assert s.kv_blocks_used == 1 and s.kv_blocks_total == 64
    run(engine)
    s = engine.stats()
    assert s.finished == {"stop": 1} and s.generation_tokens == 3 and s.kv_blocks_used == 0


ops = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 60), st.integers(1, 3), st.integers(1, 24)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 20)),
), max_size=30)


@settings(max_examples=40, deadline=None)
@given(ops)
def test_idle_engine_holds_no_blocks(program):
    engine, _ = make_engine(num_blocks=10, max_num_seqs=5, budget=32, max_model_len=200)
    finished: dict[str, set[int]] = {}
    expected: dict[str, int] = {}
    out: list[ToProxy] = []
    for i, op in enumerate(program):
        if op[0] == "submit":
            rid = f"r{i}"
            expected[rid] = op[2]
            out += engine.submit(completion(rid, "p" * op[1], n=op[2], max_tokens=op[3]))
        elif op[0] == "step":
            for _ in range(op[1]):
                out += engine.step()
        elif expected:
            rid = sorted(expected)[op[1] % len(expected)]
            out += engine.abort(rid, AbortCause.CLIENT_DISCONNECT)
    out += run(engine, max_ticks=2000)
    assert engine.block_manager.num_used == 0 and engine.sessions == {}
    for r in out:
        if isinstance(r, Finish):
            assert r.index not in finished.setdefault(r.rid, set()), "finished twice"
            finished[r.rid].add(r.index)
    for rid, n in expected.items():
        if rid in finished or not any(isinstance(r, Error) and r.rid == rid for r in out):
            assert finished.get(rid) == set(range(n))


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(2)
    return load_model("builtin:tiny", "cpu", "float32")


def tiny_engine(tiny, num_blocks: int) -> Engine:
    runner = ModelRunner(tiny.model, tiny.config, num_blocks)
    return Engine(runner, tiny.tokenizer, None, 8, 64, tiny.max_model_len, tiny.name)


def test_builtin_tiny_end_to_end_with_forks_and_preemption(tiny):
    def greedy(num_blocks: int) -> tuple[dict[str, dict[int, str]], Engine]:
        engine = tiny_engine(tiny, num_blocks)
        for i in range(3):
            engine.submit(completion(f"r{i}", f"The number {i} is", n=2, temperature=0.0,
                                     max_tokens=16, ignore_eos=True))
        out = run(engine)
        assert all(len(finishes(out, f"r{i}")) == 2 for i in range(3))
        return {f"r{i}": texts(out, f"r{i}") for i in range(3)}, engine

    roomy, _ = greedy(64)
    tight, engine = greedy(5)
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.num_used == 0
    assert tight == roomy
    assert all(got[0] == got[1] for got in roomy.values())  # greedy forks agree


def test_logprobs_follow_the_model_distribution_token_by_token():
    engine, runner = make_engine(writer("héllo", "p"))
    engine.submit(completion("lp", "p", temperature=0.0, max_tokens=50, logprobs=3))
    engine.submit(completion("plain", "p", temperature=0.0, max_tokens=50))
    out = run(engine)
    deltas = [r for r in out if isinstance(r, Delta) and r.rid == "lp"]
    assert all(r.logprobs is None for r in out if isinstance(r, Delta) and r.rid == "plain")
    ids = [t for d in deltas for t in d.token_ids]
    lps = [lp for d in deltas for lp in (d.logprobs or [])]
    assert len(lps) == len(ids) and all(len(d.logprobs or []) == len(d.token_ids) for d in deltas)
    ctx = TOK.encode("p")
    for token, lp in zip(ids, lps, strict=True):
        expected = torch.log_softmax(runner.logits(ctx), dim=-1)
        assert lp.logprob == pytest.approx(float(expected[token]), abs=1e-5)
        assert [v for _, v in lp.top] == pytest.approx(expected.topk(3).values.tolist(), abs=1e-5)
        # Greedy: the sampled token is the most likely one; its bytes are the token's own.
        assert lp.top[0] == (lp.token, pytest.approx(lp.logprob))
        assert lp.token == TOK.token_bytes(token)
        ctx.append(token)
    # "é" is two byte tokens, each half of the character; the EOS token shows its name.
    assert [lp.token for lp in lps][1:3] == list(map(bytes, (["é".encode()[0]], ["é".encode()[1]])))
    assert lps[-1].token == b"<eos>" and ids[-1] == EOS


def test_logprobs_zero_gives_the_sampled_token_only():
    engine, _ = make_engine(writer("ok", "p"))
    engine.submit(completion("lp", "p", max_tokens=50, logprobs=0, seed=3))
    lps = [lp for r in run(engine) if isinstance(r, Delta) for lp in (r.logprobs or [])]
    assert lps and all(lp.top == [] and lp.logprob <= 0.0 for lp in lps)
