"""Completions' echo through the engine on the fake runner: the prompt before the first token of
every choice, its log-probabilities from logits at every prompt position (in chunks, never from
the prefix cache, once each across a preemption), in Deltas of at most ECHO_TOKENS entries."""

from __future__ import annotations

import pytest
import torch

from ipc.records import ECHO_TOKENS, Delta, RequestKind, SamplingParams, Submit
from ipc.wire import ToProxy
from tests.support.engine_kit import TOK, make_engine, run
from tests.support.fake_runner import FakeRunner


def echo(rid: str, prompt: str, n: int = 1, **params: object) -> Submit:
    return Submit(rid, RequestKind.COMPLETION, SamplingParams(
        max_tokens=3, temperature=0.0, echo=True, **params), n=n,  # type: ignore[arg-type]
        prompts=[prompt], epoch=1)


def echoed(out: list[ToProxy], index: int = 0) -> list[Delta]:
    return [r for r in out if isinstance(r, Delta) and r.index == index and r.prompt]


def expected_logprobs(runner: FakeRunner, ids: list[int]) -> list[float]:
    """What the fake model gives each prompt token after the ones before it."""
    return [torch.log_softmax(runner.logits(ids[:p]), -1)[ids[p]].item()
            for p in range(1, len(ids))]


def test_echo_without_logprobs_is_the_prompt_before_the_first_token() -> None:
    engine, _ = make_engine()
    engine.submit(echo("a", "hello", n=2))
    out = run(engine)
    for index in (0, 1):
        [first] = echoed(out, index)
        assert (first.text, first.token_ids, first.logprobs) == ("hello", TOK.encode("hello"),
                                                                None)
        deltas = [r for r in out if isinstance(r, Delta) and r.index == index]
        assert deltas[0] is first and len(deltas) > 1


def test_prompt_logprobs_come_from_every_position_in_chunks_not_the_cache() -> None:
    engine, runner = make_engine(budget=16, num_blocks=64)
    prompt = "the quick brown fox jumps over the lazy dog, " * 3
    ids = TOK.encode(prompt)
    engine.submit(Submit("warm", RequestKind.COMPLETION, SamplingParams(max_tokens=1),
                         prompts=[prompt], epoch=1))
    run(engine)
    assert engine.scheduler.num_cache_hits == 0
    hits = engine.scheduler.num_cache_hits
    engine.submit(echo("a", prompt, logprobs=1))
    out = run(engine)
    assert engine.scheduler.num_cache_hits == hits  # every position computed
    entries = [lp for d in echoed(out) for lp in d.logprobs or ()]
    assert len(entries) == len(ids) and entries[0].token == TOK.token_bytes(ids[0])
    assert [lp.logprob for lp in entries[1:]] == pytest.approx(expected_logprobs(runner, ids))
    assert all(len(lp.top) == 1 for lp in entries[1:])
    # The prompt's blocks were in the cache: a request without echo takes them.
    engine.submit(Submit("b", RequestKind.COMPLETION, SamplingParams(max_tokens=1),
                         prompts=[prompt], epoch=1))
    run(engine)
    assert engine.scheduler.num_cache_hits > hits


def test_a_preempted_prompt_adds_only_the_entries_still_missing() -> None:
    engine, runner = make_engine(budget=16, num_blocks=64)
    prompt = "x" * 70
    ids = TOK.encode(prompt)
    engine.submit(echo("a", prompt, logprobs=0))
    out = engine.step() + engine.step()
    [seq] = engine.scheduler.running
    assert 0 < seq.num_computed < len(ids)
    engine.scheduler._preempt(seq)  # recomputed from its first token
    out += run(engine)
    entries = [lp for d in echoed(out) for lp in d.logprobs or ()]
    assert len(entries) == len(ids)
    assert [lp.logprob for lp in entries[1:]] == pytest.approx(expected_logprobs(runner, ids))


def test_a_long_prompt_echoes_in_pieces_and_every_sample_gets_it() -> None:
    engine, _ = make_engine(budget=256, num_blocks=128, max_model_len=2048)
    prompt = "y" * (ECHO_TOKENS + 100)
    engine.submit(echo("a", prompt, n=2, logprobs=2))
    out = run(engine)
    for index in (0, 1):
        pieces = echoed(out, index)
        assert [len(p.logprobs or ()) for p in pieces] == [ECHO_TOKENS, 101]
        assert pieces[0].text == prompt and pieces[1].text == "" and pieces[1].token_ids == []
        assert len(pieces[0].token_ids) == ECHO_TOKENS + 101
    assert not engine.sessions and engine.block_manager.num_used == 0
