"""Guided sessions in the engine: held until their grammar is compiled, refused when it cannot
be, valid when they finish, and evicted whole (the pending compile included)."""

from __future__ import annotations

import json
import threading

import jsonschema

from daemon.engine.grammar import Compiled, Grammars
from daemon.engine.guided import Guidance
from daemon.responses.store import ResponseStore
from ipc.reasons import Reason
from ipc.records import (
    AbortCause,
    Error,
    FinishReason,
    Guide,
    GuideKind,
    Message,
    RequestKind,
    ResponseFields,
    SamplingParams,
    Submit,
)
from tests.support.engine_kit import TOK, completion, finishes, guidance, make_engine, run, texts

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
GUIDE = Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA), source="response_format")


class HeldGrammars(Grammars):
    """Compiles only once `release` is set: a slow compile, on the real compile thread."""

    def __init__(self) -> None:
        super().__init__(TOK, TOK.special_token_ids)
        self.release = threading.Event()

    def _build(self, guide: Guide) -> Compiled:
        self.release.wait(10)
        return super()._build(guide)


def test_a_guided_completion_is_valid_json_and_stops():
    engine, _ = make_engine(guidance=guidance())
    engine.submit(completion("g", "go", n=2, max_tokens=60, temperature=1.0, guide=GUIDE))
    out = run(engine)
    for index, text in texts(out, "g").items():
        jsonschema.validate(json.loads(text), SCHEMA)
        assert finishes(out, "g")[index].reason is FinishReason.STOP


def test_a_session_waits_for_its_grammar_and_is_never_prefilled_if_its_client_leaves():
    grammars = HeldGrammars()
    engine, runner = make_engine(guidance=Guidance(grammars))
    engine.submit(completion("slow", "go", max_tokens=40, guide=GUIDE))
    engine.submit(completion("plain", "go", max_tokens=3))
    while engine.has_work:  # the plain request finishes meanwhile
        engine.admit_guided()
        engine.step()
    assert engine.waiting_for_grammar and "slow" in engine.sessions
    assert engine.stats().grammar_pending == 1  # tether_grammar_compiles_pending
    engine.abort("slow", AbortCause.CLIENT_DISCONNECT)
    assert not engine.waiting_for_grammar and not engine.sessions
    assert engine.stats().grammar_pending == 0
    grammars.release.set()
    assert run(engine) == []
    prefilled = [c for p in runner.passes for c in p if TOK.decode(c.token_ids) == "go"]
    assert len(prefilled) == 1  # the plain request's prompt only


def test_a_grammar_that_cannot_compile_is_the_request_s_400():
    engine, _ = make_engine(guidance=guidance())
    bad = Guide(GuideKind.JSON_SCHEMA, json.dumps({"type": "array", "uniqueItems": True}),
                source="response_format")
    engine.submit(completion("bad", max_tokens=20, guide=bad))
    [error] = run(engine)
    assert isinstance(error, Error) and error.reason is Reason.INVALID_GRAMMAR
    assert error.param == "response_format" and "uniqueItems" in error.message
    assert not engine.sessions


class BrokenGrammars(Grammars):
    """A compile that raises what no one expected (a grammar library's own bug)."""

    def _build(self, guide: Guide) -> Compiled:
        raise IndexError("deep inside the grammar library")


def test_a_compile_that_fails_unexpectedly_refuses_its_own_request_only():
    engine, _ = make_engine(guidance=Guidance(BrokenGrammars(TOK, TOK.special_token_ids)))
    engine.submit(completion("bad", max_tokens=20, guide=GUIDE))
    engine.submit(completion("bystander", max_tokens=3))
    out = run(engine)
    [error] = [r for r in out if isinstance(r, Error)]
    assert error.rid == "bad" and error.reason is Reason.INVALID_GRAMMAR
    assert error.param == "response_format" and "IndexError" in error.message
    assert finishes(out, "bystander") and not engine.sessions


def test_a_budget_too_small_for_the_schema_is_a_400_naming_max_tokens():
    engine, _ = make_engine(guidance=guidance())
    engine.submit(completion("tiny", max_tokens=5, guide=GUIDE))
    [error] = run(engine)
    assert isinstance(error, Error) and error.param == "max_tokens"
    # It names the budget that fits: the shortest output and the end of sequence.
    need = len('{"name":"","n":0}') + 1
    assert f"set max_tokens to at least {need}" in error.message, error.message
    engine.submit(completion("fits", max_tokens=need, guide=GUIDE))
    engine.submit(completion("short", max_tokens=need - 1, guide=GUIDE))
    out = run(engine)
    assert [e.rid for e in out if isinstance(e, Error)] == ["short"]
    assert finishes(out, "fits")[0].reason is FinishReason.STOP
    # A response names its own field.
    engine, _ = make_engine(guidance=guidance(), store=ResponseStore(None, 100, 3600.0))
    fields = ResponseFields(input=[Message("user", "hi")], model="fake")
    engine.submit(Submit("resp_tiny", RequestKind.RESPONSE,
                         SamplingParams(max_tokens=5, guide=GUIDE), response=fields, epoch=1))
    [error] = run(engine)
    assert isinstance(error, Error) and error.param == "max_output_tokens"


def test_guides_that_need_the_end_of_sequence_refuse_ignore_eos_and_min_tokens():
    engine, _ = make_engine(guidance=guidance())
    for param, extra in (("ignore_eos", {"ignore_eos": True}), ("min_tokens", {"min_tokens": 3})):
        [error] = engine.submit(completion("x", max_tokens=20, guide=GUIDE, **extra))
        assert isinstance(error, Error) and error.param == param


def test_without_a_grammar_engine_a_guided_request_is_refused():
    engine, _ = make_engine()
    [error] = engine.submit(completion("x", max_tokens=20, guide=GUIDE))
    assert isinstance(error, Error) and error.param == "response_format"


def test_a_refused_guided_response_leaves_no_stored_row():
    store = ResponseStore(None, 100, 3600.0)
    engine, _ = make_engine(guidance=guidance(), store=store)
    bad = Guide(GuideKind.REGEX, "(", source="text.format")
    fields = ResponseFields(input=[Message("user", "hi")], model="fake")
    engine.submit(Submit("resp_g", RequestKind.RESPONSE, SamplingParams(max_tokens=20, guide=bad),
                         response=fields, epoch=1))
    [error] = run(engine)
    assert isinstance(error, Error) and error.param == "text.format"
    assert store.num_placeholders() == 0 and store.num_stored() == 0


def test_masks_computed_on_the_mask_thread_are_those_computed_inline(monkeypatch):
    """Many rows of a large vocabulary go to the mask thread during the forward pass: the same
    rows, the same masks, whichever way a tick takes (siblings forked from one prompt and a
    free request in the same batch)."""

    def outputs() -> dict[str, dict[int, str]]:
        engine, _ = make_engine(guidance=guidance())
        engine.submit(completion("g", "go", n=3, max_tokens=40, temperature=0.0, guide=GUIDE))
        engine.submit(completion("free", "go", max_tokens=12, temperature=0.0))
        out = run(engine)
        return {rid: texts(out, rid) for rid in ("g", "free")}

    inline = outputs()
    monkeypatch.setattr("daemon.engine.guided.MASK_THREAD_MIN_TOKENS", 0)
    threaded = outputs()
    assert threaded == inline
    for text in threaded["g"].values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_grammar_at_its_parser_limit_ends_its_own_request_with_a_400():
    """Each token's parse of an ambiguous grammar grows with the output; at the server's row
    cap the request ends with its 400 (every sequence of it), and the request beside it runs
    on."""
    engine, _ = make_engine(guidance=guidance())
    ambiguous = Guide(GuideKind.GRAMMAR, 'start: e\ne: e e e | e e | /[a-z]/ | ""',
                      source="guided_grammar")
    engine.submit(completion("amb", n=2, max_tokens=400, temperature=1.0, guide=ambiguous))
    engine.submit(completion("plain", max_tokens=300, ignore_eos=True))
    out = run(engine, max_ticks=1000)
    [error] = [r for r in out if isinstance(r, Error)]
    assert (error.rid, error.param, error.reason) == (
        "amb", "guided_grammar", Reason.GRAMMAR_TOO_COMPLEX)
    assert "parser items" in error.message
    assert not finishes(out, "amb") and not engine.sessions
    assert finishes(out, "plain")[0].reason is FinishReason.LENGTH
    assert finishes(out, "plain")[0].usage.completion_tokens == 300
