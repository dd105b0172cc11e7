"""The closing search: bounded in matcher steps and in time whatever the grammar, and telling
why it found nothing."""

from __future__ import annotations

import time

import llguidance
import pytest

from daemon.engine.closing import SearchBound, Stopped, closing
from daemon.engine.grammar import PARSER_LIMITS, Grammars, grammar_text
from daemon.model.tokenizer import ByteTokenizer
from ipc.records import Guide, GuideKind

TOK = ByteTokenizer()
# Ambiguous, and closed by a byte the search does not prefer: the search walks letters, each
# step dearer than the last (unbounded, it took minutes).
NEVER_CLOSES = 'start: "<" e "!"\ne: e e | "<" e "!" | /[a-z]/ | ""\n'


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(TOK, TOK.special_token_ids)


def matcher(grammars: Grammars, lark: str) -> llguidance.LLMatcher:
    """A matcher under the server's parser limits, without the compile's own search."""
    return llguidance.LLMatcher(grammars.tokenizer, grammar_text(Guide(GuideKind.GRAMMAR, lark)),
                                limits=PARSER_LIMITS, log_level=0)


class Ticks:
    """A clock that moves a millisecond each time it is read."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        self.now += 0.001
        return self.now


def test_a_search_stops_at_its_steps(grammars: Grammars) -> None:
    bound = SearchBound.within(300, 3600.0)
    start = time.monotonic()
    assert closing(matcher(grammars, NEVER_CLOSES), grammars.byte_tokens, bound) is Stopped.BOUND
    assert bound.exhausted and 0 <= bound.steps_left < 300
    assert time.monotonic() - start < 10.0  # generous: 300 steps of a grammar this small


def test_a_search_stops_at_its_deadline() -> None:
    grammars = Grammars(TOK, TOK.special_token_ids)
    clock = Ticks()
    bound = SearchBound.within(10**9, 0.05, clock)  # 50 reads of the clock
    assert closing(matcher(grammars, NEVER_CLOSES), grammars.byte_tokens, bound) is Stopped.BOUND
    assert bound.exhausted and bound.steps_left > 10**9 - 100 and clock.reads <= 52


def test_a_parser_limit_on_the_way_is_told_apart(grammars: Grammars) -> None:
    """Right recursion grows a row an item a byte: the walk meets the row cap."""
    found = closing(matcher(grammars, 'start: "<" e "!"\ne: /[a-z]/ e | ""\n'),
                    grammars.byte_tokens, SearchBound.within(10**6, 3600.0))
    assert found is Stopped.PARSER_LIMIT


@pytest.mark.parametrize("lark", ['start: "(" e ")"\ne: e e | "(" e ")" | /[a-z]/ | ""\n',
                                  'start: "<" e ">"\ne: /[a-z]/ e | ""\n',
                                  'start: "[" e "]"\ne: /[a-z]/ | e "," e\n'])
def test_brackets_close_before_anything_else(grammars: Grammars, lark: str) -> None:
    """The issue's 60-byte grammar walked letters for 4,096 bytes: its bracket comes first."""
    bound = SearchBound.within(1000, 3600.0)
    found = closing(matcher(grammars, lark), grammars.byte_tokens, bound)
    assert isinstance(found, bytes) and len(found) <= 3, found
    assert bound.steps_left > 1000 - 50
