"""Each format's parser, fed every split of its text: the same content and calls come out
wherever the pieces were cut (token boundaries, merged deltas, a call split over ticks)."""

from __future__ import annotations

import itertools

import pytest

from ipc.records import ToolCallFormat
from proxy.tool_calls import FORMATS
from proxy.tool_calls.parser import CallArguments, CallStart, Content, Event

Calls = list[tuple[str, str, str]]  # (id, name, arguments)


def parse(fmt: ToolCallFormat, pieces: list[str], names: tuple[str, ...] = ("get", "put"),
          parallel: bool = True) -> list[Event]:
    parser = FORMATS[fmt].parser(frozenset(names), lambda i: f"call{i}", parallel)
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.end()


def merged(events: list[Event]) -> tuple[str, Calls]:
    """The content and the calls the events add up to; each call begun once, before its
    arguments, indices in order."""
    content = ""
    calls: Calls = []
    for event in events:
        if isinstance(event, Content):
            content += event.text
        elif isinstance(event, CallStart):
            assert event.index == len(calls)
            calls.append((event.call_id, event.name, ""))
        else:
            assert isinstance(event, CallArguments) and event.index < len(calls)
            call_id, name, args = calls[event.index]
            calls[event.index] = (call_id, name, args + event.text)
    return content, calls


def splits(text: str, parts: int) -> list[list[str]]:
    cuts = itertools.combinations(range(1, len(text)), parts - 1)
    return [[text[a:b] for a, b in zip((0, *c), (*c, len(text)), strict=True)] for c in cuts]


CASES: list[tuple[ToolCallFormat, str, str, Calls]] = [
    (ToolCallFormat.HERMES,
     'Sure! \n<tool_call>\n{"name": "get", "arguments": {"city": "Par\\"is"}}\n</tool_call>\n'
     '<tool_call>\n{"arguments": {"x": [1, {"y": "}"}]}, "name": "put"}\n</tool_call>',
     "Sure!", [("call0", "get", '{"city": "Par\\"is"}'),
               ("call1", "put", '{"x": [1, {"y": "}"}]}')]),
    (ToolCallFormat.HERMES, "plain <tool text, no call", "plain <tool text, no call", []),
    (ToolCallFormat.HERMES, "a <tool_call>{nope} b", "a <tool_call>{nope} b", []),
    (ToolCallFormat.HERMES, '<tool_call>{"name": "other", "arguments": {}}</tool_call> x',
     '<tool_call>{"name": "other", "arguments": {}}</tool_call> x', []),
    (ToolCallFormat.HERMES, '<tool_call>\n{"name": "get", "arguments": "{\\"a\\": 1}"}',
     "", [("call0", "get", '{"a": 1}')]),
    (ToolCallFormat.LLAMA3_JSON,
     ' {"name": "get", "parameters": {"a": 1}}; {"name": "put", "parameters": {}}', "",
     [("call0", "get", '{"a": 1}'), ("call1", "put", "{}")]),
    (ToolCallFormat.LLAMA3_JSON, ' {"name": "Ada", "age": 3}', ' {"name": "Ada", "age": 3}', []),
    (ToolCallFormat.LLAMA3_JSON, "  text {", "  text {", []),
    (ToolCallFormat.MISTRAL,
     'hi [TOOL_CALLS][{"name": "get", "arguments": {"a": 1}}, {"name": "put", "arguments": '
     '"{\\"q\\": 2}"}]', "hi", [("call0", "get", '{"a": 1}'), ("call1", "put", '{"q": 2}')]),
    (ToolCallFormat.MISTRAL,
     '[TOOL_CALLS]get[ARGS]{"a": 1}[TOOL_CALLS]put[CALL_ID]abc123456[ARGS]{"b": [2]}', "",
     [("call0", "get", '{"a": 1}'), ("call1", "put", '{"b": [2]}')]),
    (ToolCallFormat.MISTRAL, "[TOOL_] no", "[TOOL_] no", []),
    (ToolCallFormat.HERMES, "cut <tool_c", "cut <tool_c", []),
    (ToolCallFormat.MISTRAL, "cut [TOOL_CALLS]ge", "cut [TOOL_CALLS]ge", []),
    (ToolCallFormat.MISTRAL, "cut [TOOL_CALLS] [", "cut [TOOL_CALLS] [", []),
    (ToolCallFormat.HERMES, "\n\n", "\n\n", []),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_every_split_gives_the_same_content_and_calls(fmt: ToolCallFormat, text: str,
                                                      content: str, calls: Calls) -> None:
    assert merged(parse(fmt, [text])) == (content, calls)
    assert merged(parse(fmt, list(text))) == (content, calls)
    for pieces in splits(text, 2) + splits(text, 3)[::7]:
        assert merged(parse(fmt, pieces)) == (content, calls), pieces


def test_a_call_is_begun_before_its_arguments_stream() -> None:
    text = '<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call>'
    events = parse(ToolCallFormat.HERMES, list(text))
    starts = [i for i, e in enumerate(events) if isinstance(e, CallStart)]
    pieces = [e for e in events if isinstance(e, CallArguments)]
    assert len(starts) == 1 and len(pieces) > 5  # the arguments come as they are read
    assert starts[0] < events.index(pieces[0])


def test_parallel_false_keeps_the_first_call() -> None:
    text = ('<tool_call>{"name": "get", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "put", "arguments": {}}</tool_call>')
    assert merged(parse(ToolCallFormat.HERMES, [text], parallel=False)) == (
        "", [("call0", "get", "{}")])
