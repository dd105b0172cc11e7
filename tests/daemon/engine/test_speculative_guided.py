"""Speculative decoding with structured outputs: a constrained sequence drafts what its grammar
forces (jump-forward) and the n-gram's drafts the grammar allows, each verified under the mask
after the drafts before it; its output is token for token what it is without, in fewer passes,
and unconstrained drafts beside grammar-masked rows keep theirs."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from tokenizers import Tokenizer as Tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from daemon.engine import guided
from daemon.engine.core import Engine
from daemon.engine.execute import Executed
from daemon.engine.speculative import NgramConfig, accepted
from daemon.model.tokenizer import HFTokenizer, Tokenizer
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
from tests.support.fake_runner import FakeRunner, Script

NGRAM = NgramConfig(num_speculative_tokens=8, prompt_lookup_max=3, prompt_lookup_min=1)
FIELDS = {"name": "string", "city": "string", "age": "integer", "email": "string",
          "zip": "string", "year": "integer"}
SCHEMA = {"type": "object", "properties": {k: {"type": t} for k, t in FIELDS.items()},
          "required": list(FIELDS), "additionalProperties": False}
GUIDE = Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA), source="response_format")
ANSWER = ('{"name":"Ann Lee","city":"Oslo","age":41,"email":"ann@lee.no","zip":"0150",'
          '"year":1983}')
PROMPT = "Who is she? Answer in JSON."  # nothing of the answer to copy: drafts are the grammar's


def writer(prompt: str, text: str) -> Script:
    """The model writes `text` after `prompt`, then EOS; once its output strays from `text` (a
    grammar's closing), a token that depends on the last one read back through the block
    table (so a stale KV position changes the logprobs)."""
    n_prompt = len(TOK.encode(prompt))
    data = list(text.encode())

    def script(ctx: list[int]) -> int:
        at = len(ctx) - n_prompt
        if ctx[n_prompt:] != data[:at]:
            return (ctx[-1] * 7 + 3) % 256
        return data[at] if at < len(data) else EOS
    return script


def generate(speculative: NgramConfig | None, script: Script, prompt: str = PROMPT,
             guide: Guide = GUIDE, **params: Any) -> tuple[list[ToProxy], Engine, FakeRunner]:
    engine, runner = make_engine(script, guidance=guidance(), speculative=speculative)
    engine.submit(completion("a", prompt, guide=guide,
                             **{"temperature": 0.0, "max_tokens": 120, **params}))
    out = run(engine)
    assert engine.block_manager.num_used == 0 and engine.sessions == {}
    return out, engine, runner


def decode_sizes(runner: FakeRunner, prompt: str = PROMPT,
                 tok: Tokenizer = TOK) -> list[int]:
    """The tokens of each decode chunk (1 + its drafts)."""
    n_prompt = len(tok.encode(prompt))
    return [len(c.token_ids) for p in runner.passes for c in p if c.start_pos >= n_prompt]


def token_ids(out: list[ToProxy]) -> list[int]:
    return [t for r in out if isinstance(r, Delta) for t in r.token_ids]


def logprobs(out: list[ToProxy]) -> list[TokenLogprob]:
    return [lp for r in out if isinstance(r, Delta) for lp in r.logprobs or ()]


def test_a_schema_s_fixed_keys_are_drafted_and_the_output_is_the_same_in_fewer_passes() -> None:
    plain, _, plain_runner = generate(None, writer(PROMPT, ANSWER))
    spec, engine, runner = generate(NGRAM, writer(PROMPT, ANSWER))
    assert texts(plain, "a")[0] == ANSWER
    assert token_ids(spec) == token_ids(plain)
    assert finishes(spec, "a")[0] == finishes(plain, "a")[0]
    s = engine.speculation
    assert s is not None and s.num_accepted_tokens >= 40, (s.num_drafts, s.num_accepted_tokens)
    # The keys and punctuation (55 of the 86 bytes) come several a pass.
    assert len(runner.passes) <= len(plain_runner.passes) - 40


def test_what_a_grammar_forces_is_drafted_k_at_most() -> None:
    """A pass gives a sequence at most 1 + num_speculative_tokens tokens (guarantee A20), the
    keys a schema forces too."""
    k = NgramConfig(num_speculative_tokens=2, prompt_lookup_max=3, prompt_lookup_min=1)
    plain, _, _ = generate(None, writer(PROMPT, ANSWER))
    spec, engine, runner = generate(k, writer(PROMPT, ANSWER))
    assert token_ids(spec) == token_ids(plain)
    assert engine.speculation is not None and engine.speculation.num_accepted_tokens > 0
    assert max(decode_sizes(runner)) == 3


def bpe() -> HFTokenizer:
    """A byte-level BPE trained on the answer: its keys, `{"`, `":"`, `","` and `":` are
    tokens, as in a real model's vocabulary, so what a key forces is ambiguous to spell (the
    byte tokenizer spells each byte alone)."""
    tok = Tokenizers(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([ANSWER] * 10, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return HFTokenizer(tok, None, None, "</s>")


@pytest.mark.parametrize("split", [False, True])
def test_a_key_s_colon_and_quote_are_drafted_with_it(split: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """After a value the grammar forces the next key and its `":"` (or `":`): both are
    drafted, where llguidance's jump-forward tokens stop after the key (`":` might start
    `":"`). `split`: the model writes `":` then `"` where its tokenizer has the one token
    `":"`, as SmolLM2 does: from the second key on, drafts spell it its way."""
    monkeypatch.setattr(guided, "TICK_DRAFT_S", 60.0)  # a busy machine cuts no draft here
    tok = bpe()
    n_prompt, eos = len(tok.encode(PROMPT)), tok.eos_token_ids[0]
    answer = tok.encode(ANSWER)
    assert [tok.token_bytes(t) for t in answer[:3]] == [b'{"', b"name", b'":"']
    if split:
        [joined], [colon], [quote] = tok.encode('":"'), tok.encode('":'), tok.encode('"')
        answer = [t for token in answer for t in ((colon, quote) if token == joined else [token])]

    def script(ctx: list[int]) -> int:
        at = len(ctx) - n_prompt
        return answer[at] if ctx[n_prompt:] == answer[:at] and at < len(answer) else eos

    outs = []
    for speculative in (None, NGRAM):
        engine, runner = make_engine(script, guidance=guidance(tok), speculative=speculative,
                                     tokenizer=tok)
        engine.submit(completion("a", PROMPT, guide=GUIDE, temperature=0.0, max_tokens=120))
        outs.append(token_ids(run(engine)))
    assert outs[0] == outs[1] == [*answer, eos]
    drafts = [tuple(c.token_ids[1:]) for p in runner.passes for c in p
              if c.start_pos >= n_prompt]
    # Each key with what follows it up to its value: `":"` or `":`, or `":` and `"`.
    keys = [at for at, t in enumerate(answer) if tok.token_bytes(t).decode() in FIELDS]
    runs = [tuple(answer[at:at + (3 if tok.token_bytes(answer[at + 2]) == b'"' else 2)])
            for at in keys]
    missed = [run for run in runs[split:] if not any(_holds(d, run) for d in drafts)]
    assert len(runs) == len(FIELDS) and not missed, [[tok.token_bytes(t) for t in run]
                                                     for run in missed]
    # So each field costs a pass less than drafting its key alone did.
    assert len(decode_sizes(runner, PROMPT, tok)) <= len(answer) - 2 * len(FIELDS)


def _holds(drafts: tuple[int, ...], run: tuple[int, ...]) -> bool:
    return any(drafts[at:at + len(run)] == run for at in range(len(drafts)))


COPIED = f"Like this: {ANSWER} Now yours."  # the answer to copy: drafts hold values too


@pytest.mark.parametrize(("prompt", "params"), [
    (PROMPT, {"logprobs": 2}), (PROMPT, {"max_tokens": 70, "logprobs": 1}),
    (COPIED, {"max_tokens": 64, "logprobs": 1}), (PROMPT, {"stop": ['"age']})])
def test_logprobs_the_closing_budget_and_stops_are_as_without(prompt: str,
                                                              params: dict[str, Any]) -> None:
    """max_tokens 64 or 70 cannot hold the answer: the grammar closes the output early, in
    place of a sampled token (with COPIED, one of the drafts it accepted: the drafts after it
    are not kept, nor their KV), then spells its closing token by token (drafted too); the same
    with and without."""
    plain, _, _ = generate(None, writer(prompt, ANSWER), prompt, **params)
    spec, engine, _ = generate(NGRAM, writer(prompt, ANSWER), prompt, **params)
    assert token_ids(spec) == token_ids(plain), params
    assert logprobs(spec) == logprobs(plain)
    assert finishes(spec, "a")[0] == finishes(plain, "a")[0]
    assert engine.speculation is not None and engine.speculation.num_accepted_tokens > 0
    if "max_tokens" in params:
        jsonschema.validate(json.loads(texts(spec, "a")[0]), SCHEMA)


def test_each_row_after_a_draft_is_masked_as_one_at_a_time() -> None:
    """The model would put a space after each colon, which compact JSON refuses, and writes
    junk once it strays: the grammar picks most tokens, at rows after drafts too; each must be
    masked as the grammar stands after the drafts before it."""
    spaced = ANSWER.replace(":", ": ")
    plain, _, _ = generate(None, writer(COPIED, spaced), COPIED, logprobs=1)
    spec, engine, _ = generate(NGRAM, writer(COPIED, spaced), COPIED, logprobs=1)
    assert token_ids(spec) == token_ids(plain)
    assert logprobs(spec) == logprobs(plain)
    jsonschema.validate(json.loads(texts(spec, "a")[0]), SCHEMA)
    assert engine.speculation is not None and engine.speculation.num_accepted_tokens > 10


def test_n_gram_drafts_are_cut_where_the_grammar_refuses_them() -> None:
    """The prompt holds the answer with a key the schema does not have: the drafts copied
    from it are cut before that key, which is never verified."""
    prompt = COPIED.replace('"zip"', '"postcode"')
    long = NgramConfig(num_speculative_tokens=16, prompt_lookup_max=3, prompt_lookup_min=1)
    spec, engine, runner = generate(long, writer(prompt, ANSWER), prompt)
    plain, _, _ = generate(None, writer(prompt, ANSWER), prompt)
    assert token_ids(spec) == token_ids(plain) and texts(spec, "a")[0] == ANSWER
    assert engine.speculation is not None and engine.speculation.num_accepted_tokens > 40
    n_prompt = len(TOK.encode(prompt))
    drafted = [TOK.decode(c.token_ids) for p in runner.passes for c in p
               if c.start_pos >= n_prompt and len(c.token_ids) > 1]
    # "ann@lee.no" copied on from the prompt, up to the key (drafts long enough to reach it)
    assert any(d.endswith('.no","') for d in drafted), drafted
    assert not any("po" in d for d in drafted), drafted


def test_the_tick_s_draft_work_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seven steps a tick: one for the grammar's forced tokens, two per draft; three drafts."""
    monkeypatch.setattr(guided, "TICK_DRAFT_STEPS", 7)
    plain, _, _ = generate(None, writer(PROMPT, ANSWER))
    spec, _, runner = generate(NGRAM, writer(PROMPT, ANSWER))
    assert token_ids(spec) == token_ids(plain)
    assert max(decode_sizes(runner)) == 4


def test_no_drafts_past_the_tick_s_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guided, "TICK_DRAFT_S", 0.0)
    plain, _, _ = generate(None, writer(PROMPT, ANSWER))
    spec, engine, _ = generate(NGRAM, writer(PROMPT, ANSWER))
    assert token_ids(spec) == token_ids(plain)
    s = engine.speculation
    assert s is not None and s.num_drafts == 0, (s.num_drafts, s.num_accepted_tokens)


def test_unconstrained_drafts_beside_a_grammar_masked_row_are_kept() -> None:
    """A copying stream beside a constrained one: in the steps they share, the copying
    stream's drafts are verified (not dropped), and both outputs are as without."""
    copy_prompt = "the cat sat on the mat. the cat sat on the mat. the cat"
    copy_text = " sat on the mat. the cat sat on the mat."
    json_prompt = TOK.encode(PROMPT)
    n_copy = len(TOK.encode(copy_prompt))

    def script(ctx: list[int]) -> int:  # each request's answer, told apart by its prompt
        if ctx[:len(json_prompt)] == json_prompt:
            return writer(PROMPT, ANSWER)(ctx)
        return writer(copy_prompt, copy_text)(ctx) if len(ctx) >= n_copy else EOS

    results, shared = [], 0
    for speculative in (None, NGRAM):
        engine, _ = make_engine(script, guidance=guidance(), speculative=speculative)
        engine.submit(completion("json", PROMPT, max_tokens=120, temperature=0.0, guide=GUIDE))
        out: list[ToProxy] = []
        while not engine.has_work:  # its grammar compiles on a thread
            out += engine.admit_guided()
        engine.submit(completion("copy", copy_prompt, max_tokens=60, temperature=0.0))
        def spy(batch: Any, execute: Any = engine.execute) -> Executed:
            nonlocal shared
            executed = execute(batch)
            rows = executed.rows()
            for i, drafts in executed.drafts.items():
                if (executed.masks is not None and executed.seqs[i].rid == "copy"
                        and accepted(drafts, rows[i])):
                    shared += 1
            return executed

        engine.execute = spy  # type: ignore[method-assign]
        out += run(engine)
        results.append((texts(out, "copy"), texts(out, "json"), logprobs(out)))
        assert engine.block_manager.num_used == 0
    assert results[0] == results[1]
    assert results[0][1][0] == ANSWER and results[0][0][0] == copy_text
    assert shared >= 2, shared


def test_n_gram_drafts_that_miss_after_a_key_back_off_and_the_key_s_do_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in the prompt to copy: after each key the n-gram proposes an earlier value
    (the output's `":"` came before one), rejected, a verify row each. Those back off as an
    unconstrained sequence's do (they did not while the key before them was accepted: 49
    rejected drafts); the keys the grammar forces are drafted all the same."""
    monkeypatch.setattr(guided, "TICK_DRAFT_S", 60.0)  # a busy machine cuts no draft here
    plain, _, _ = generate(None, writer(PROMPT, ANSWER))
    spec, engine, _ = generate(NGRAM, writer(PROMPT, ANSWER))
    assert token_ids(spec) == token_ids(plain)
    s = engine.speculation
    assert s is not None and s.num_accepted_tokens >= 45, s.num_accepted_tokens
    assert s.num_draft_tokens - s.num_accepted_tokens <= 30, (s.num_draft_tokens,
                                                              s.num_accepted_tokens)
