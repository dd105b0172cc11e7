"""Requests take turns, not sequences: a small request arriving behind a big one is served
within a tick or two and its output is what it would have been alone (fake runner: a wrong
block table after a preemption gives a wrong token)."""

from __future__ import annotations

from ipc.reasons import Reason
from ipc.records import Delta, Error, Finish, Submit
from tests.support.engine_kit import completion, finishes, make_engine, run, texts

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def ticks_until_finished(engine, rid: str, limit: int) -> tuple[int, list]:
    out: list = []
    for tick in range(1, limit + 1):
        out += engine.step()
        if any(isinstance(r, Finish) and r.rid == rid for r in out):
            return tick, out
    return limit + 1, out


def alone(submit: Submit) -> dict[int, str]:
    engine, _ = make_engine(num_blocks=256, max_num_seqs=8)
    engine.submit(submit)
    return texts(run(engine, max_ticks=2000), submit.rid)


def big_requests() -> list[Submit]:
    many = completion("many", **GREEDY, max_tokens=40)
    many.prompts = [f"prompt {i}" for i in range(24)]
    return [completion("wide", "a wide one", n=8, max_tokens=60, **GREEDY), many]


def test_a_small_request_behind_a_big_one_finishes_first_with_its_own_text() -> None:
    small = completion("small", "quick", max_tokens=5, **GREEDY)
    for big in big_requests():
        engine, _ = make_engine(num_blocks=256, max_num_seqs=8)
        engine.submit(big)
        out = [r for _ in range(3) for r in engine.step()]
        engine.submit(small)
        # Its prompt, then 5 tokens: a tick to be let in, one token a tick after.
        ticks, more = ticks_until_finished(engine, "small", 10)
        assert ticks <= 7, big.rid
        out += more
        assert not any(isinstance(r, Finish) and r.rid == big.rid for r in out)
        out += run(engine, max_ticks=2000)
        assert texts(out, "small") == alone(small)
        assert texts(out, big.rid) == alone(big)
        assert len(finishes(out, big.rid)) == big.num_sequences
        assert engine.block_manager.num_used == 0


def test_a_request_over_the_sequence_cap_is_refused_naming_the_field() -> None:
    engine, _ = make_engine()
    engine.intake.max_seqs_per_request = 16
    wide = completion("wide", n=8)
    wide.prompts = ["a", "b", "c"]
    [err] = engine.submit(wide)
    assert isinstance(err, Error) and (err.param, err.reason) == ("n", Reason.TOO_MANY_SEQUENCES)
    assert "24 sequences" in err.message and "16" in err.message
    many = completion("many")
    many.prompts = ["p"] * 17
    [err] = engine.submit(many)
    assert isinstance(err, Error) and err.param == "prompt" and "17" in err.message
    at_cap = completion("ok", n=8)
    at_cap.prompts = ["a", "b"]
    assert not any(isinstance(r, Error) for r in engine.submit(at_cap))
    assert all(not isinstance(r, Delta) or r.rid == "ok" for r in run(engine))
