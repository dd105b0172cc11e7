from __future__ import annotations

import pytest

from proxy.errors import ApiError
from proxy.schemas import (
    ChatRequest,
    CompletionRequest,
    check_chat,
    check_completion,
    check_model,
    client_request_id,
    decode_body,
    new_id,
    sampling_params,
)


def error_of(body: bytes, struct_type: type = CompletionRequest) -> ApiError:
    with pytest.raises(ApiError) as info:
        decode_body(body, struct_type)
    assert info.value.status == 400
    return info.value


def test_limit_violation_names_the_field_and_the_limit() -> None:
    exc = error_of(b'{"prompt": "x", "max_tokens": 0}')
    assert exc.param == "max_tokens"
    assert ">= 1" in exc.message and "max_tokens" in exc.message


def test_nested_path_becomes_the_param() -> None:
    exc = error_of(b'{"messages": [{"role": "robot", "content": "x"}]}', ChatRequest)
    assert exc.param == "messages[0].role"
    exc = error_of(b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
                   ChatRequest)
    assert exc.param == "messages[0].content[0].type"


def test_missing_field_is_named() -> None:
    assert error_of(b'{"max_tokens": 3}').param == "prompt"
    exc = error_of(b'{"messages": [{"role": "user"}]}', ChatRequest)
    assert exc.param == "messages[0].content"
    assert exc.code == "missing_required_parameter"


def test_bad_json_and_wrong_types() -> None:
    assert error_of(b'{"prompt": ').code == "invalid_json"
    assert error_of(b"\xff\xfe").code == "invalid_json"
    assert error_of(b"[1, 2]").param is None
    assert error_of(b'{"prompt": "x", "temperature": "hot"}').param == "temperature"
    assert error_of(b'{"prompt": "x", "n": 1000}').param == "n"
    assert error_of(b'{"prompt": []}').param == "prompt"
    assert error_of(b'{"prompt": [1, 2]}').param == "prompt[0]"
    assert error_of(b'{"prompt": "x", "top_p": 0}').param == "top_p"


def test_prompt_forms_and_stop_forms() -> None:
    one = decode_body(b'{"prompt": "a", "stop": "\\n"}', CompletionRequest)
    many = decode_body(b'{"prompt": ["a", "b"], "stop": ["x", ""]}', CompletionRequest)
    assert one.prompts == ["a"] and many.prompts == ["a", "b"]
    assert sampling_params(one, None, "max_tokens", 128).stop == ["\n"]
    assert sampling_params(many, None, "max_tokens", 128).stop == ["x"]


def test_sampling_defaults_and_limits() -> None:
    req = decode_body(b'{"prompt": "a", "top_k": 0, "seed": 7, "min_tokens": 2}',
                      CompletionRequest)
    params = sampling_params(req, None, "max_tokens", 128)
    assert (params.max_tokens, params.top_k, params.seed, params.temperature) == (16, -1, 7, 1.0)
    with pytest.raises(ApiError) as info:
        sampling_params(req, 1, "max_tokens", 128)
    assert info.value.param == "min_tokens"
    with pytest.raises(ApiError) as info:
        sampling_params(req, 500, "max_completion_tokens", 128)
    assert info.value.param == "max_completion_tokens" and "128" in info.value.message


def test_unsupported_options_are_refused_not_ignored() -> None:
    with pytest.raises(ApiError) as info:
        check_completion(decode_body(b'{"prompt": "a", "echo": true}', CompletionRequest))
    assert info.value.param == "echo"
    with pytest.raises(ApiError) as info:
        check_chat(decode_body(b'{"messages": [{"role": "user", "content": "a"}], '
                               b'"presence_penalty": 1.5}', ChatRequest))
    assert info.value.param == "presence_penalty"
    check_chat(decode_body(b'{"messages": [{"role": "user", "content": "a"}], '
                           b'"presence_penalty": 0, "logprobs": false}', ChatRequest))


def test_text_parts_are_joined_and_developer_is_system() -> None:
    req = decode_body(b'{"messages": [{"role": "developer", "content": "be brief"}, '
                      b'{"role": "user", "content": [{"type": "text", "text": "a"}, '
                      b'{"type": "text", "text": "b"}]}]}', ChatRequest)
    records = [m.to_record() for m in req.messages]
    assert [(r.role, r.content) for r in records] == [("system", "be brief"), ("user", "a\nb")]


def test_request_id_rules() -> None:
    assert client_request_id("abc-1.2:3_x") == "abc-1.2:3_x"
    assert client_request_id(None) is None
    for bad in ("", "has space", "x" * 129, "slash/"):
        with pytest.raises(ApiError):
            client_request_id(bad)
    assert new_id("cmpl-").startswith("cmpl-") and new_id("cmpl-") != new_id("cmpl-")


def test_unknown_model_is_404() -> None:
    check_model(None, ("m",))
    check_model("m", ("m",))
    with pytest.raises(ApiError) as info:
        check_model("gpt-4", ("m",))
    assert (info.value.status, info.value.code, info.value.param) == (
        404, "model_not_found", "model")
