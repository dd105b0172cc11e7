"""Speculative decoding by prompt lookup: proposing, the configuration, and greedy output that is
token for token what it is without speculation (the fake runner reads every context token back
through the block table, so KV left by a rejected draft would change a token)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon.engine.core import Engine
from daemon.engine.speculative import MAX_LOOKS, NgramConfig, accepted, parse_config, propose
from ipc.records import Delta, Guide, GuideKind, TokenLogprob
from ipc.wire import ToProxy
from tests.support.engine_kit import (
    EOS,
    TOK,
    completion,
    finishes,
    guidance,
    make_engine,
    run,
    texts,
)
from tests.support.fake_runner import Script, hash_script

NGRAM = NgramConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"


def copier(prompt: str, text: str) -> Script:
    """The model writes `text` after `prompt`, then EOS."""
    n_prompt = len(TOK.encode(prompt))
    data = text.encode()
    return lambda ctx: data[len(ctx) - n_prompt] if len(ctx) - n_prompt < len(data) else EOS


def repeater(prompt: str, period: int, every: int) -> Script:
    """The model repeats what it read `period` tokens ago (so a wrong token read back through
    the block table changes all that follows), but every `every`th token it writes the next
    byte instead: drafts are accepted, then rejected."""
    n_prompt = len(TOK.encode(prompt))

    def script(ctx: list[int]) -> int:
        written = len(ctx) - n_prompt
        if written >= 50:
            return EOS
        return (ctx[-period] + (written % every == every - 1)) % 256
    return script


def generate(script: Script, speculative: NgramConfig | None, prompt: str = PROMPT,
             **params: Any) -> tuple[list[ToProxy], Engine, int]:
    engine, runner = make_engine(script, speculative=speculative)
    engine.submit(completion("a", prompt, **{"temperature": 0.0, "max_tokens": 60, **params}))
    out = run(engine)
    assert engine.block_manager.num_used == 0 and engine.sessions == {}
    return out, engine, len(runner.passes)


def token_ids(out: list[ToProxy]) -> list[int]:
    return [t for r in out if isinstance(r, Delta) for t in r.token_ids]


def logprobs(out: list[ToProxy]) -> list[TokenLogprob]:
    return [lp for r in out if isinstance(r, Delta) for lp in r.logprobs or ()]


def test_propose_takes_what_followed_the_longest_latest_suffix() -> None:
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], NGRAM, 4) == [7, 1, 2, 3]
    assert propose([5, 1, 2, 6, 2], NGRAM, 2) == [6, 2]  # one token of suffix, latest match
    assert propose([1, 2, 3, 4], NGRAM, 4) == []  # nothing repeats
    assert propose([7, 7, 7, 7, 7, 7], NGRAM, 3) == [7, 7, 7]  # not the one-token latest
    assert propose([1, 2, 9, 1, 2], NGRAM, 4) == [9, 1, 2]  # all that followed it
    assert propose([1, 2, 1, 2], NGRAM, 0) == []


def plain_propose(ids: list[int], config: NgramConfig, limit: int) -> list[int]:
    """`propose` as a Python loop over every start, to hold the byte search to."""
    num, limit = len(ids), min(limit, config.num_speculative_tokens)
    for n in range(min(config.prompt_lookup_max, num - 1), config.prompt_lookup_min - 1, -1):
        found: list[int] = []
        for start in range(num - n - 1, -1, -1):
            if limit > 0 and ids[start:start + n] == ids[num - n:]:
                found = found or ids[start + n:start + n + limit]
                if start + n + limit <= num:
                    return ids[start + n:start + n + limit]
        if found:
            return found
    return []


@given(st.lists(st.sampled_from([1, 2, 3, 256, 257, 65537, 1 << 24]), max_size=40),
       st.integers(0, 6))
def test_the_byte_search_finds_what_a_loop_over_every_start_finds(ids: list[int],
                                                                  limit: int) -> None:
    # Ids of several bytes: a match across two ids' bytes is no match.
    assert propose(ids, NGRAM, limit) == plain_propose(ids, NGRAM, limit)


def test_a_search_looks_at_a_bounded_number_of_occurrences() -> None:
    """Ids a client chooses can make every period of the context a match across two ids'
    bytes (1280, 1792 spell 00 05 00 00 00 07 00 00: the bytes of 5, 7 from the second byte
    on); the search passes over MAX_LOOKS of them and gives up, where it once took a Python
    step for each, so a true match behind them is not found: the tick's cost is bounded."""
    ids = [5, 7, 9] + [1280, 1792] * (MAX_LOOKS + 1) + [5, 7]
    assert propose(ids, NGRAM, 1) == []
    assert plain_propose(ids, NGRAM, 1) == [9]
    assert propose(ids[:3] + [1280, 1792] * (MAX_LOOKS - 2) + [5, 7], NGRAM, 1) == [9]


def test_accepted_is_the_longest_matching_prefix() -> None:
    assert accepted([4, 5, 6], [4, 5, 7, 8]) == 2
    assert accepted([4, 5, 6], [4, 5, 6, 8]) == 3
    assert accepted([4], [3, 4]) == 0


@pytest.mark.parametrize(("text", "message"), [
    ('{"method": "eagle", "num_speculative_tokens": 3, "prompt_lookup_max": 3}', "method"),
    ('{"method": "ngram", "prompt_lookup_max": 3}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_max": 3}',
     "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 3}', "prompt_lookup_max"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, '
     '"prompt_lookup_min": 4}', "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "model": "x"}',
     "'model'"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, '
     '"disable_by_batch_size": 0}', "disable_by_batch_size"),
    ("[1]", "object"),
    ("{", "JSON"),
])
def test_a_config_other_than_ngram_is_refused_naming_the_field(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_config(text)


def test_parse_config_as_vllm_spells_it() -> None:
    assert parse_config("") is None
    assert parse_config('{"method": "ngram", "num_speculative_tokens": 5, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}') == NgramConfig(5, 4, 2)
    assert parse_config('{"method": "ngram", "num_speculative_tokens": 5, '
                        '"prompt_lookup_max": 4}') == NgramConfig(5, 4, 4)
    assert parse_config('{"method": "ngram", "num_speculative_tokens": 5, '
                        '"prompt_lookup_max": 4, "disable_by_batch_size": 8}'
                        ) == NgramConfig(5, 4, 4, 8)


def test_no_drafts_in_a_step_of_more_decodes_than_disable_by_batch_size() -> None:
    script = copier(PROMPT, " sat on the mat. the cat sat on the mat.")
    counts = []
    for limit in (1, 2):
        engine, _ = make_engine(script, speculative=NgramConfig(4, 3, 1, limit))
        engine.submit(completion("a", PROMPT, n=2, temperature=0.0, max_tokens=20))
        out = run(engine)
        assert texts(out, "a") == {0: " sat on the mat. the", 1: " sat on the mat. the"}
        assert engine.speculation is not None
        counts.append(engine.speculation.num_drafts)
    assert counts[0] == 0 < counts[1]


def test_greedy_output_that_copies_its_prompt_is_identical_in_fewer_passes() -> None:
    script = copier(PROMPT, " sat on the mat. the cat sat on the mat.")
    plain, _, plain_passes = generate(script, None)
    spec, engine, spec_passes = generate(script, NGRAM)
    assert token_ids(spec) == token_ids(plain) and texts(spec, "a") == texts(plain, "a")
    assert finishes(spec, "a")[0].usage == finishes(plain, "a")[0].usage
    s = engine.speculation
    assert s is not None and s.num_accepted_tokens > 0 and s.num_drafts > 0
    assert spec_passes < plain_passes
    stats = engine.stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens) == (
        s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)


def test_rejected_drafts_leave_no_trace_in_the_kv_or_the_prefix_cache() -> None:
    script = repeater(PROMPT, len("the cat sat on the mat. "), 11)
    plain, _, _ = generate(script, None)
    spec, engine, _ = generate(script, NGRAM)
    assert token_ids(spec) == token_ids(plain)
    s = engine.speculation
    assert s is not None and 0 < s.num_accepted_tokens < s.num_draft_tokens
    # The prefix cache now holds the blocks it filled: a second run reads them back.
    engine.submit(completion("b", PROMPT, temperature=0.0, max_tokens=60))
    again = run(engine)
    assert texts(again, "b") == texts(plain, "a")


def test_max_tokens_stop_strings_and_logprobs_behave_as_without() -> None:
    script = copier(PROMPT, " sat on the mat. the cat sat on the mat.")
    for params in ({"max_tokens": 7}, {"stop": ["mat. the"]}, {"logprobs": 2},
                   {"stop_token_ids": [ord(".")]}):
        plain, _, _ = generate(script, None, **params)
        spec, _, _ = generate(script, NGRAM, **params)
        assert texts(spec, "a") == texts(plain, "a"), params
        assert finishes(spec, "a")[0] == finishes(plain, "a")[0], params
        assert logprobs(spec) == logprobs(plain), params


# A copy of "a"s, whose pick (4.0 against the fake runner's spread of 0 to 2) the penalties turn
# after a few, within a drafted stretch; bans that fall inside one ("mat" after "ma"; "." before
# min_tokens, at each place the boundary can fall within a step's drafts). Repetition needs no
# case of its own: a draft is a token of the context, already seen by its every row.
A = "a" * 16
PENALISED = [(A, {"frequency_penalty": 0.45}),
             (A, {"frequency_penalty": 0.3, "presence_penalty": 1.0}),
             (A, {"frequency_penalty": 0.2, "repetition_penalty": 1.5}),
             (PROMPT, {"repetition_penalty": 1.9}),
             (PROMPT, {"bad_words": ["mat", "on t"]}),
             *((PROMPT, {"min_tokens": m, "stop_token_ids": [ord(".")]}) for m in range(14, 24))]


@pytest.mark.parametrize(("prompt", "params"), PENALISED, ids=str)
def test_penalised_and_banning_rows_draft_and_give_the_output_of_without(
        prompt: str, params: dict[str, Any]) -> None:
    """Each row of a drafted sequence counts the drafts before it as its output: its
    penalties, bad words and min_tokens are those one-token decoding would have applied."""
    text = A if prompt == A else " sat on the mat. the cat sat on the mat."
    script = copier(prompt, text)
    plain, _, _ = generate(script, None, prompt, logprobs=1, **params)
    spec, engine, _ = generate(script, NGRAM, prompt, logprobs=1, **params)
    assert token_ids(spec) == token_ids(plain)
    assert finishes(spec, "a")[0] == finishes(plain, "a")[0]
    assert logprobs(spec) == logprobs(plain)
    s = engine.speculation
    assert s is not None and s.num_drafts > 0 and s.num_accepted_tokens > 0


COPY = " sat on the mat. the cat sat on the mat."


def samples(speculative: NgramConfig | None, n: int = 64, seed: int = 7, prompt: str = PROMPT,
            text: str = COPY, **params: Any) -> tuple[list[str], Engine]:
    script = copier(prompt, text)
    engine, _ = make_engine(script, num_blocks=600, max_num_seqs=n, budget=1024,
                            speculative=speculative)
    engine.submit(completion("a", prompt, n=n, seed=seed, max_tokens=12,
                             **{"temperature": 0.5, "top_k": 50, **params}))
    out = texts(run(engine), "a")
    return [out[i] for i in range(n)], engine


def test_seeded_samples_repeat_with_speculation() -> None:
    first, engine = samples(NGRAM)
    again, _ = samples(NGRAM)
    assert first == again
    assert engine.speculation is not None and engine.speculation.num_accepted_tokens > 0


def kept(outs: list[str], script: str) -> float:
    """The mean length of the prefix of `script` the samples keep."""
    lengths = [next((i for i, (a, b) in enumerate(zip(t, script, strict=False)) if a != b),
                    min(len(t), len(script))) for t in outs]
    return sum(lengths) / len(lengths)


@pytest.mark.parametrize(("prompt", "text", "params", "mean"), [
    # Each token is the script's with probability about 0.6 (temperature 0.5 over the fake
    # runner's spread), so the prefix a sample keeps of the script is geometric.
    (PROMPT, COPY, {}, (0.5, 4.0)),
    # Nearly certain at first (temperature 0.3), each "a" counted makes the next less likely:
    # a row that did not count the drafts before it would keep more.
    (A, A, {"temperature": 0.3, "frequency_penalty": 0.45}, (1.0, 6.0)),
], ids=["plain", "frequency_penalty"])
def test_sampled_output_is_distributed_as_without_speculation(
        prompt: str, text: str, params: dict[str, Any], mean: tuple[float, float]) -> None:
    # The mean length of the prefix kept must agree within a few standard errors.
    plain = sum([kept(samples(None, 64, seed, prompt, text, **params)[0], text)
                 for seed in range(8)]) / 8
    runs = [samples(NGRAM, 64, 100 + seed, prompt, text, **params) for seed in range(8)]
    drafted = sum([kept(texts, text) for texts, _ in runs]) / 8
    # 512 samples a side: the standard error of each mean is about 0.1 (seeded: no flake).
    assert abs(plain - drafted) < 0.4, (plain, drafted)
    assert mean[0] < plain < mean[1]  # neither greedy (12) nor never the script
    assert sum([e.speculation.num_accepted_tokens for _, e in runs if e.speculation]) > 100


def test_a_sequence_whose_drafts_fail_backs_off() -> None:
    # The answer is a hash of its context: its tokens occurred before (the suffix of one token
    # finds a match), what followed them never comes again.
    script = hash_script(TOK.vocab_size)
    plain, _, _ = generate(script, None, max_tokens=200)
    spec, engine, _ = generate(script, NGRAM, max_tokens=200)
    assert token_ids(spec) == token_ids(plain)
    s = engine.speculation
    assert s is not None and s.num_accepted_tokens <= 1
    # Waits of 2, 4, 8, 16, 32, 32, ... steps after each failure: a handful of drafts, not 200.
    assert 0 < s.num_drafts <= 12, s.num_drafts


def test_drafts_never_take_the_room_of_a_request_waiting_its_turn() -> None:
    """A wide request whose eight sequences all draft, in a cache nearly too small for it: a
    small request arriving behind it still finishes within the ticks it takes without
    speculation, with its own text."""
    prompt = "abcdabcdabcd"
    script = repeater(prompt, 4, 1000)
    results = []
    for speculative in (None, NGRAM):
        engine, _ = make_engine(script, num_blocks=44, max_num_seqs=8,
                                speculative=speculative)
        engine.submit(completion("wide", prompt, n=8, max_tokens=60, temperature=0.0))
        out = [r for _ in range(3) for r in engine.step()]
        engine.submit(completion("small", "quick", max_tokens=5, temperature=0.0))
        ticks = 0
        while not finishes(out, "small"):
            out += engine.step()
            ticks += 1
        out += run(engine)
        results.append((ticks, texts(out, "small"), texts(out, "wide")))
        assert engine.block_manager.num_used == 0
        assert speculative is None or (engine.speculation is not None
                                       and engine.speculation.num_accepted_tokens > 0)
    (plain_ticks, plain_small, plain_wide), (ticks, small, wide) = results
    assert ticks <= max(plain_ticks, 7) and small == plain_small and wide == plain_wide


def test_drafts_beside_a_grammar_masked_row_are_dropped_and_the_output_is_the_same() -> None:
    """A step with a constrained row samples a drafted sequence's first row only: its drafts
    are all rejected (no gain, and no mask row to mismatch); both outputs are as without."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    guide = Guide(GuideKind.JSON_SCHEMA, json.dumps(schema), source="response_format")
    script = copier(PROMPT, " sat on the mat. the cat sat on the mat.")
    results = []
    for speculative in (None, NGRAM):
        engine, _ = make_engine(script, guidance=guidance(), speculative=speculative)
        engine.submit(completion("json", PROMPT, max_tokens=30, temperature=0.0, guide=guide))
        out = []
        while not engine.has_work:  # its grammar compiles on a thread
            out += engine.admit_guided()
        engine.submit(completion("copy", PROMPT, max_tokens=30, temperature=0.0))
        out += run(engine)
        results.append((texts(out, "copy"), texts(out, "json"), logprobs(out)))
        assert engine.block_manager.num_used == 0
    assert results[0] == results[1]
