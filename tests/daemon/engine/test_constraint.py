"""A constraint on the tick: a closing search that cannot finish within its bound closes the
output, still valid; a matcher at its parser limits ends with an error naming them; each
token's work stays bounded whatever the grammar."""

from __future__ import annotations

import json
import time

import pytest

from daemon.engine.closing import SearchBound
from daemon.engine.constraint import (
    SEARCH_FLOOR_S,
    SEARCH_S,
    TICK_SEARCH_STEPS,
    Constraint,
    search_bound,
)
from daemon.engine.grammar import MAX_ITEMS_IN_ROW, GrammarError, Grammars
from daemon.model.tokenizer import ByteTokenizer
from ipc.records import Guide, GuideKind

TOK = ByteTokenizer()
EOS = TOK.eos_token_ids[0]
# A key that opens an object of required fields: its closing must be searched again.
SCHEMA = {"type": "object", "additionalProperties": False, "properties": {
    "n": {"type": "integer"},
    "big": {"type": "object", "additionalProperties": False, "required": ["p", "q"],
            "properties": {"p": {"type": "string"}, "q": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(TOK, TOK.special_token_ids)


def constraint(grammars: Grammars, guide: Guide) -> Constraint:
    return Constraint(grammars, grammars.compile(guide).result())


def test_a_search_out_of_bound_closes_from_where_it_was(grammars: Grammars) -> None:
    c = constraint(grammars, Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    out = bytearray()
    for byte in b'{"n":1':
        assert c.accept(byte, 100) == byte
        out.append(byte)
    spent = SearchBound(0, time.monotonic() + 3600.0)  # nothing left for a search
    token = c.accept(ord(","), 100, bound=spent)  # commits to "big", which "}" cannot close
    assert token != ord(",")  # the closing from before it took its place
    while token != EOS:
        out.append(token)
        token = c.accept(ord(","), 100)
    assert list(json.loads(out)) == ["n"], out


def test_a_matcher_at_its_row_cap_ends_with_an_error_naming_it(grammars: Grammars) -> None:
    """Each token's parse of this grammar grew with the output (0.5 s a token at llguidance's
    default cap of 2,000 items); under the server's cap each stays bounded, then it ends."""
    c = constraint(grammars, Guide(GuideKind.GRAMMAR, 'start: e\ne: e e e | e e | /[a-z]/ | ""'))
    worst = 0.0
    with pytest.raises(GrammarError) as info:
        for i in range(1000):
            start = time.monotonic()
            c.accept(ord("a") + i % 26, 1000 - i)
            c.compute_mask()
            worst = max(worst, time.monotonic() - start)
    assert info.value.code == "grammar_too_complex"
    assert f"{MAX_ITEMS_IN_ROW} parser items" in str(info.value)
    assert i < 300 and worst < 0.5, (i, worst)  # generous: about 20 ms here at worst


def test_a_tick_s_searches_share_its_deadline_above_a_floor() -> None:
    now = 10.0
    alone = search_bound(now, now + 1.0)
    assert alone.deadline == now + SEARCH_S and alone.steps == TICK_SEARCH_STEPS
    assert search_bound(now, now + 0.001).deadline == now + SEARCH_FLOOR_S
    assert search_bound(now, now - 5.0).deadline == now + SEARCH_FLOOR_S
