"""A chat Submit's tools and tool turns, rendered into its prompt by the chat template."""

from __future__ import annotations

from daemon.model.tokenizer import ByteTokenizer
from daemon.prompts import render_prompts, template_message, template_tool
from daemon.rejected import ContextBytes
from ipc.records import Message, RequestKind, SamplingParams, Submit, ToolCall, ToolFunction

TOK = ByteTokenizer()


def test_tools_and_tool_turns_reach_the_template() -> None:
    call = ToolCall("c1", "get", '{"q": "x"}')
    submit = Submit("r", RequestKind.CHAT, SamplingParams(), messages=[
        Message("user", "hi"), Message("assistant", None, [call]),
        Message("tool", "42", tool_call_id="c1")],
        tools=[ToolFunction("get", "Gets.", '{"type": "object"}')])
    text = TOK.decode(render_prompts(submit, TOK, None, ContextBytes(512, 12))[0])
    assert '{"type": "function", "function": {"name": "get", "description": "Gets.", ' \
           '"parameters": {"type": "object"}}}' in text
    assert '<tool_call>\n{"name": "get", "arguments": {"q": "x"}}\n</tool_call>' in text
    assert text.endswith("tool\n42\nassistant\n")  # (the byte specials decode to nothing)


def test_messages_and_tools_as_templates_read_them() -> None:
    assert template_message(Message("assistant", None, [ToolCall("c", "f", "not json")])) == {
        "role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "not json"}}]}
    assert template_message(Message("tool", "x", tool_call_id="c")) == {
        "role": "tool", "content": "x", "tool_call_id": "c"}
    assert template_message(Message("user", "hi")) == {"role": "user", "content": "hi"}
    assert template_tool(ToolFunction("f")) == {"type": "function", "function": {"name": "f"}}
