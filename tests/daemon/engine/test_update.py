"""Several tokens a sequence in one step (what speculative decoding will hand the update phase):
the step's update and emit phases end a sequence at the token that ends it, wherever it falls
among them, and the grammar accepts them one by one."""

from __future__ import annotations

import re
import time

import torch

from daemon.engine.core import Engine
from ipc.records import Delta, Finish, FinishReason, Guide, GuideKind
from ipc.wire import ToProxy
from tests.support.engine_kit import EOS, TOK, completion, finishes, guidance, make_engine, texts


def ids(text: str) -> list[int]:
    return list(text.encode())


def step_with(engine: Engine, rows: dict[str, list[int]],
              logits: torch.Tensor | None = None) -> list[ToProxy]:
    """One real step whose sampled sequences get `rows[rid]` in place of the token the runner's
    logits gave; `logits` has a row per token, in that order."""
    batch = engine.schedule()
    executed = engine.execute(batch)
    executed.ids = [list(rows[seq.rid]) for seq in executed.seqs]
    starts, at = [], 0
    for row in executed.ids:
        starts.append(at)
        at += len(row)
    executed.starts = starts
    executed.logits = torch.zeros(at, TOK.vocab_size) if logits is None else logits
    advanced, out = engine.update(batch, executed)
    return out + engine.emit(advanced)


def sent_ids(out: list[ToProxy], rid: str) -> list[int]:
    return [t for r in out if isinstance(r, Delta) and r.rid == rid for t in r.token_ids]


def ended_cleanly(engine: Engine) -> bool:
    return not engine.sessions and engine.block_manager.num_used == 0


def test_a_stop_string_among_the_tokens_ends_the_sequence_there():
    engine, _ = make_engine()
    engine.submit(completion("a", max_tokens=50, stop=["XY"]))
    out = step_with(engine, {"a": ids("aXYbc")})
    assert texts(out, "a") == {0: "a"}
    finish = finishes(out, "a")[0]
    assert finish.reason is FinishReason.STOP
    # The tokens after the stop string were never the answer's: not sent, not counted.
    assert sent_ids(out, "a") == ids("aXY") and finish.usage.completion_tokens == 3
    assert ended_cleanly(engine)


def test_a_stop_string_across_two_steps_of_several_tokens():
    engine, _ = make_engine()
    engine.submit(completion("a", max_tokens=50, stop=["XYZ"]))
    out = step_with(engine, {"a": ids("abX")})
    assert texts(out, "a") == {0: "ab"}  # X may start the stop string: held back
    out += step_with(engine, {"a": ids("YZcd")})
    assert texts(out, "a") == {0: "ab"} and finishes(out, "a")[0].reason is FinishReason.STOP
    assert sent_ids(out, "a") == ids("abXYZ")


def test_an_end_of_sequence_among_the_tokens_ends_it_and_drops_the_rest():
    engine, _ = make_engine()
    engine.submit(completion("a", max_tokens=50))
    out = step_with(engine, {"a": [*ids("ab"), EOS, *ids("cd")]})
    assert texts(out, "a") == {0: "ab"}
    finish = finishes(out, "a")[0]
    assert finish.reason is FinishReason.STOP and finish.usage.completion_tokens == 3
    assert sent_ids(out, "a") == [*ids("ab"), EOS]
    assert ended_cleanly(engine)


def test_an_end_of_sequence_before_min_tokens_is_text_like_any_token():
    engine, _ = make_engine()
    engine.submit(completion("a", max_tokens=50, min_tokens=4, stop_token_ids=[ord("b")]))
    out = step_with(engine, {"a": ids("abcbd")})
    # The first "b" is the second token, before min_tokens: it goes on; the second ends it.
    assert texts(out, "a") == {0: "abc"}
    assert finishes(out, "a")[0].usage.completion_tokens == 4


def test_max_tokens_among_the_tokens_ends_it_with_length():
    engine, _ = make_engine()
    engine.submit(completion("a", max_tokens=3))
    out = step_with(engine, {"a": ids("abcde")})
    assert texts(out, "a") == {0: "abc"}
    finish = finishes(out, "a")[0]
    assert finish.reason is FinishReason.LENGTH and finish.usage.completion_tokens == 3
    assert ended_cleanly(engine)


def test_the_next_step_computes_the_tokens_a_step_added():
    engine, runner = make_engine()
    engine.submit(completion("a", "hello", max_tokens=50))
    prompt = len(TOK.encode("hello"))
    step_with(engine, {"a": ids("abc")})
    out = step_with(engine, {"a": ids("d")})
    # Three tokens to compute, in one chunk after the prompt; the fake runner read every
    # position back through the block table.
    chunk = runner.passes[-1][0]
    assert (chunk.start_pos, TOK.decode(chunk.token_ids)) == (prompt, "abc")
    assert texts(out, "a") == {0: "d"} and "a" in engine.sessions


def test_one_token_and_several_tokens_sequences_share_a_step():
    engine, _ = make_engine()
    engine.submit(completion("one", max_tokens=50))
    engine.submit(completion("many", max_tokens=50))
    out = step_with(engine, {"one": ids("x"), "many": ids("wxyz")})
    assert texts(out, "one") == {0: "x"} and texts(out, "many") == {0: "wxyz"}
    assert sent_ids(out, "many") == ids("wxyz")


def test_each_token_carries_its_log_probability():
    engine, _ = make_engine()
    engine.submit(completion("a", max_tokens=50, logprobs=2, stop=["c"]))
    logits = torch.randn(4, TOK.vocab_size)
    out = step_with(engine, {"a": ids("abcd")}, logits)
    [delta] = [r for r in out if isinstance(r, Delta)]
    assert delta.logprobs is not None and len(delta.logprobs) == 3  # "d" is not the answer's
    expected = torch.log_softmax(logits, dim=-1)
    for row, (token, entry) in enumerate(zip(ids("abc"), delta.logprobs, strict=True)):
        assert entry.token == bytes([token])
        assert abs(entry.logprob - float(expected[row, token])) < 1e-5
        assert [t for t, _ in entry.top] == [TOK.token_bytes(int(i)) for i in expected[row].topk(2)[1]]


def _guided(engine: Engine, rid: str, regex: str) -> None:
    engine.submit(completion(rid, max_tokens=20, guide=Guide(GuideKind.REGEX, regex)))
    while engine.waiting_for_grammar:  # it compiles on its own thread
        assert engine.admit_guided() == []
        time.sleep(0.001)
    assert engine.has_work


def test_the_grammar_accepts_each_token_and_closes_from_the_first_it_refuses():
    engine, _ = make_engine(guidance=guidance())
    _guided(engine, "g", "ab{1,3}c")
    out = step_with(engine, {"g": ids("abbxy")})
    # x is not allowed: the closing's first token takes its place, and y goes with it.
    text = texts(out, "g")[0]
    assert text[:3] == "abb" and len(text) == 4 and not finishes(out, "g")
    for _ in range(4):  # the rest of the closing is forced, whatever was drafted
        if finishes(out, "g"):
            break
        out += step_with(engine, {"g": ids("qq")})
    assert re.fullmatch("ab{1,3}c", texts(out, "g")[0])
    assert finishes(out, "g")[0].reason is FinishReason.STOP
    assert sent_ids(out, "g")[-1] == EOS and ended_cleanly(engine)


def test_the_grammar_consumes_nothing_past_an_end_of_sequence():
    engine, _ = make_engine(guidance=guidance())
    _guided(engine, "g", "ab")
    out = step_with(engine, {"g": [*ids("ab"), EOS, *ids("ab")]})
    assert texts(out, "g") == {0: "ab"}
    assert [r.reason for r in out if isinstance(r, Finish)] == [FinishReason.STOP]
    assert ended_cleanly(engine)
