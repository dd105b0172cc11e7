"""Chat answers with tool calls: the stream's events as OpenAI writes them, and a collected
message that says what the stream says."""

from __future__ import annotations

import json
from typing import Any

from ipc.records import Delta, Finish, FinishReason, ToolCallFormat, ToolFunction, Usage
from proxy.openai.chat_tools import ChatToolCalls
from proxy.openai.chunks import StreamChunks
from proxy.openai.completion_answer import CHAT
from proxy.tool_calls import ToolUse

USE = ToolUse((ToolFunction("get"),), "auto")
TEXT = 'Hi.<tool_call>\n{"name": "get", "arguments": {"q": "x"}}\n</tool_call>'


def stream(pieces: list[str], token_ids: bool = False) -> list[dict[str, Any]]:
    tools = ChatToolCalls(USE, ToolCallFormat.HERMES)
    chunks = StreamChunks(CHAT, {"id": "c"}, False, token_ids)
    events = [tools.event(chunks, Delta("c", 0, piece, [1]), None, token_ids) for piece in pieces]
    events.append(tools.event(chunks, Finish("c", 0, FinishReason.STOP, Usage(1, 1)), "stop",
                              token_ids))
    return [json.loads(e.removeprefix(b"data: ")) for e in events if e]


def test_a_stream_names_each_call_once_then_streams_its_arguments() -> None:
    events = stream(list(TEXT))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": "H"}
    calls = [piece for d in deltas for piece in d.get("tool_calls", [])]
    assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                        "function": {"name": "get", "arguments": ""}}
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
               for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == '{"q": "x"}'
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert len(events) < len(TEXT)  # the text held while the call's head was read sends nothing


def test_a_turn_that_opens_with_a_call_says_null_content_first() -> None:
    """As OpenAI's first delta of a tool-call turn: the role and `content: null`, then the
    call (a client adding the deltas up ends with null, as the collected message has)."""
    events = stream(list(TEXT[3:]))
    first = events[0]["choices"][0]["delta"]
    assert first == {"role": "assistant", "content": None}
    assert all("content" not in e["choices"][0]["delta"] for e in events[1:])


def test_held_text_still_carries_its_token_ids() -> None:
    events = stream(list(TEXT), token_ids=True)
    assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == len(TEXT)


def test_the_collected_message_is_the_stream_put_together() -> None:
    tools = ChatToolCalls(USE, ToolCallFormat.HERMES)
    message = tools.message(0, TEXT)
    assert message == {"role": "assistant", "content": "Hi.", "tool_calls": [
        {"id": message["tool_calls"][0]["id"], "type": "function",
         "function": {"name": "get", "arguments": '{"q": "x"}'}}]}
    assert tools.finish_reason(0, "stop") == "tool_calls"
    plain = ChatToolCalls(USE, ToolCallFormat.HERMES)
    assert plain.message(1, "no call") == {"role": "assistant", "content": "no call"}
    assert plain.finish_reason(1, "stop") == "stop"
