"""Responses input items: decoded into typed, bounded fields by msgspec (a bad one is a 400
naming the field), turned into chat messages, stored without what is neither rendered nor
bounded, and listed back."""

import time
from typing import Any

import msgspec
import pytest

from ipc.records import Message, ToolCall
from proxy.http.errors import ApiError
from proxy.responses.input_items import (
    MAX_INPUT_ITEMS,
    MAX_ITEM_ID,
    ItemReference,
    input_item_objects,
    stored_items,
)
from proxy.responses.request import Decoded, decode_request, parse_request

SERVED = ("tiny",)


def _decoded(body: bytes, served: tuple[str, ...]) -> Decoded:
    """A request with no item references, decoded as create_response decodes it."""
    req, items = parse_request(body, served)
    assert isinstance(items, str) or not any(isinstance(i, ItemReference) for i in items)
    return decode_request(body, req, items)  # type: ignore[arg-type]


def _decode(body: dict[str, Any] | bytes) -> list[Message]:
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    return _decoded(raw, SERVED).messages


def _refused(body: dict[str, Any] | bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        _decode(body)
    assert info.value.status == 400
    return info.value


def test_string_input_becomes_one_user_message() -> None:
    # Instructions are not among them: the daemon puts them first, before the history.
    assert _decode({"input": "hi", "instructions": "be brief"}) == [Message("user", "hi")]
    assert msgspec.json.decode(stored_items("hi")) == [
        {"type": "message", "role": "user", "content": "hi"}]


def test_message_items_with_string_and_part_content() -> None:
    items: list[dict[str, Any]] = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "c", "annotations": [], "logprobs": None}]},
    ]
    assert _decode({"input": items}) == [
        Message("system", "rules"),
        Message("user", "ab"),
        Message("assistant", "c"),
    ]


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([], "input"),
        ({"role": "user"}, "input"),
        ([{"role": "user"}], "input[0].content"),
        ([{"role": "tool", "content": "x"}], "input[0].role"),
        ([{"role": ["user"], "content": "x"}], "input[0].role"),
        ([{"role": "user", "content": "x"}, "hello"], "input[1]"),
        ([{"type": "web_search_call", "id": "ws_1"}], "input[0].type"),
        ([{"type": "function_call", "name": "f"}], "input[0].call_id"),
        ([{"type": "function_call", "call_id": "c", "name": "no such", "arguments": "{}"}],
         "input[0].name"),
        ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
        ([{"type": "function_call_output", "call_id": "c", "output": 3}], "input[0].output"),
        ([{"role": "user", "content": "x"}, {"type": "reasoning", "id": "rs_1"}],
         "input[1].summary"),
        ([{"role": "user", "content": 7}], "input[0].content"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
         "input[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "input_text"}]}], "input[0].content[0].text"),
        ([{"role": "user", "content": [{"text": "x"}]}], "input[0].content[0].type"),
        ([{"role": "user", "content": "x", "status": "done"}], "input[0].status"),
    ],
)
def test_invalid_input_names_the_item_and_field(items: Any, param: str) -> None:
    error = _refused({"input": items})
    assert error.param == param
    assert f"'{param}'" in error.message


def test_unsupported_types_say_what_is_served() -> None:
    item = _refused({"input": [{"type": "web_search_call", "id": "ws_1"}]})
    assert "unsupported item type 'web_search_call'" in item.message
    assert "'function_call_output'" in item.message and "'item_reference'" in item.message
    part = _refused({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})
    assert "unsupported content part 'input_image'" in part.message
    assert "'input_text', 'output_text' and 'refusal'" in part.message


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"}
CALL_2 = {**CALL, "call_id": "call_2", "id": "fc_2", "arguments": '{"city": "Oslo"}'}
TOOL_TURN = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
    CALL, CALL_2,
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {"type": "function_call_output", "call_id": "call_2",
     "output": [{"type": "input_text", "text": "ra"}, {"type": "input_text", "text": "in"}]},
]


def test_function_calls_and_their_outputs_are_tool_turns() -> None:
    """Calls in a row are one assistant turn; a reasoning item is not rendered."""
    calls = [ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
             ToolCall("call_2", "get_weather", '{"city": "Oslo"}')]
    assert _decode({"input": TOOL_TURN}) == [
        Message("user", "Weather in Paris and Oslo?"),
        Message("assistant", None, calls),
        Message("tool", "sunny", tool_call_id="call_1"),
        Message("tool", "rain", tool_call_id="call_2"),
    ]


def test_a_namespace_functions_call_renders_under_its_qualified_name() -> None:
    call = {**CALL, "namespace": "agents", "name": "spawn"}
    assert _decode({"input": [call]}) == [
        Message("assistant", None, [ToolCall("call_1", "agents.spawn", '{"city": "Paris"}')])]


def test_a_call_joins_the_assistant_message_before_it() -> None:
    items = [{"role": "user", "content": "hi"},
             {"type": "message", "role": "assistant", "content": [
                 {"type": "output_text", "text": "Let me look."}]}, CALL,
             {"type": "message", "role": "assistant", "content": [
                 {"type": "refusal", "refusal": "no"}]}]
    assert _decode({"input": items})[1:] == [
        Message("assistant", "Let me look.",
                [ToolCall("call_1", "get_weather", '{"city": "Paris"}')]),
        Message("assistant", "no")]


def test_tool_items_are_stored_and_listed_as_sent() -> None:
    stored = _decoded(msgspec.json.encode({"input": TOOL_TURN}), SERVED).items
    assert msgspec.json.decode(stored)[1:4] == [TOOL_TURN[1], CALL, CALL_2]
    listed = input_item_objects(stored, [f"item_{i}" for i in range(len(TOOL_TURN))])
    assert [i["type"] for i in listed] == [
        "message", "reasoning", "function_call", "function_call", "function_call_output",
        "function_call_output"]
    assert listed[2] == {**CALL, "id": "item_2"}
    assert listed[4] == {"type": "function_call_output", "call_id": "call_1", "output": "sunny",
                         "id": "item_4", "status": "completed"}
    assert listed[1]["encrypted_content"] == "opaque"


@pytest.mark.parametrize(("item", "param"), [
    ({"role": "user", "content": "x", "junk": [[], []]}, "input[0].junk"),
    ({"role": "user", "content": [{"type": "input_text", "text": "x", "junk": 1}]},
     "input[0].content[0].junk"),
])
def test_a_field_the_server_does_not_know_is_an_unknown_parameter(
        item: dict[str, Any], param: str) -> None:
    error = _refused({"input": [item]})
    assert (error.param, error.code) == (param, "unknown_parameter")
    assert error.message == f"Unknown parameter: '{param}'."


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": "x", "id": "i" * (MAX_ITEM_ID + 1)}]},
     "input[0].id"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
    ({"input": "x", "previous_response_id": "r" * 129}, "previous_response_id"),
    ({"input": "x", "previous_response_id": "resp_ x"}, "previous_response_id"),
])
def test_fields_are_bounded_as_openai_bounds_them(body: dict[str, Any], param: str) -> None:
    error = _refused(body)
    assert error.param is not None and error.param.startswith(param), error.message


def test_the_largest_allowed_id_is_kept_and_what_is_not_rendered_is_not() -> None:
    item = {"type": "message", "role": "assistant", "id": "i" * MAX_ITEM_ID, "content": [
        {"type": "output_text", "text": "c", "annotations": [{"type": "url_citation"}],
         "logprobs": [[[[]]]]}]}
    stored = _decoded(msgspec.json.encode({"input": [item]}), SERVED).items
    assert msgspec.json.decode(stored) == [
        {"type": "message", "role": "assistant", "id": "i" * MAX_ITEM_ID,
         "content": [{"type": "output_text", "text": "c"}]}]


def test_a_pathological_body_is_refused_without_being_walked() -> None:
    """1.3 million empty lists in one item (3.9 MB): the decoder stops at the unknown field."""
    junk = b",".join([b"[]"] * 1_300_000)
    body = b'{"input": [{"role": "user", "content": "hi", "junk": [' + junk + b"]}]}"
    t0 = time.perf_counter()
    msgspec.json.decode(body)  # what walking it costs, on this machine, now
    walked = time.perf_counter() - t0
    t0 = time.perf_counter()
    error = _refused(body)
    assert time.perf_counter() - t0 < walked / 4
    assert error.param == "input[0].junk"


def test_deep_json_where_a_part_may_hold_it_is_refused_too() -> None:
    logprobs = b"[" * 5000 + b"]" * 5000
    body = (b'{"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "x",'
            b' "logprobs": ' + logprobs + b"}]}]}")
    assert "nested" in _refused(body).message


def test_stored_items_are_listed_as_messages_with_typed_parts() -> None:
    items = '[{"role": "user", "content": "hi"}, {"type": "message", "role": "assistant", ' \
        '"id": "msg_mine", "content": [{"type": "output_text", "text": "yo"}]}]'
    listed = input_item_objects(items, ["msg_abc_0", "msg_mine"])
    assert [(i["id"], i["role"], i["status"]) for i in listed] == [
        ("msg_abc_0", "user", "completed"), ("msg_mine", "assistant", "completed")]
    assert listed[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert listed[1]["content"] == [{"type": "output_text", "text": "yo"}]


CUSTOM_TURN = [
    {"type": "custom_tool_call", "call_id": "call_p", "name": "apply_patch",
     "input": "*** Begin Patch\n\"é\"", "id": "ctc_1", "status": "completed"},
    {"type": "custom_tool_call_output", "call_id": "call_p", "output": "Done."},
]


def test_a_custom_tools_call_and_output_are_a_tool_turn_stored_as_sent() -> None:
    """The call renders as the function it is offered as: its input the one string argument."""
    assert _decode({"input": CUSTOM_TURN}) == [
        Message("assistant", None, [ToolCall("call_p", "apply_patch",
                                             '{"input": "*** Begin Patch\\n\\"é\\""}')]),
        Message("tool", "Done.", tool_call_id="call_p")]
    stored = _decoded(msgspec.json.encode({"input": CUSTOM_TURN}), SERVED).items
    listed = input_item_objects(stored, ["item_0", "item_1"])
    assert listed == [{**CUSTOM_TURN[0], "id": "item_0"},
                      {**CUSTOM_TURN[1], "id": "item_1", "status": "completed"}]


def test_more_input_items_than_the_bound_are_a_400_naming_it() -> None:
    """Each item costs the loop and the tick its own work, so their number is bounded beside
    the body's bytes (138,000 empty ones fit in 4 MiB)."""
    item = b'{"role":"user","content":""}'
    _decode(b'{"input":[' + b",".join([item] * MAX_INPUT_ITEMS) + b"]}")
    error = _refused(b'{"input":[' + b",".join([item] * (MAX_INPUT_ITEMS + 1)) + b"]}")
    assert error.param == "input" and str(MAX_INPUT_ITEMS) in error.message
