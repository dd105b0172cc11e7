from __future__ import annotations

import pytest

from proxy.bodies import check_model, client_request_id, decode_body, new_id
from proxy.http.errors import ApiError
from proxy.openai.schemas import (
    ChatRequest,
    CompletionRequest,
    check_chat,
    check_completion,
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
    assert error_of(b'{"prompt": [1.5, 2]}').param == "prompt[0]"
    assert error_of(b'{"prompt": [-1]}').param == "prompt[0]"
    assert error_of(b'{"prompt": [[]]}').param == "prompt[0]"
    assert error_of(b'{"prompt": "x", "top_p": 0}').param == "top_p"


def test_prompt_forms_and_stop_forms() -> None:
    one = decode_body(b'{"prompt": "a", "stop": "\\n"}', CompletionRequest)
    many = decode_body(b'{"prompt": ["a", "b"], "stop": ["x", ""]}', CompletionRequest)
    assert one.prompts == ["a"] and many.prompts == ["a", "b"]
    assert (one.prompt_ids, many.prompt_ids, many.num_prompts) == ([], [], 2)
    ids = decode_body(b'{"prompt": [1, 2, 3]}', CompletionRequest)
    lists = decode_body(b'{"prompt": [[1], [2, 3]]}', CompletionRequest)
    assert (ids.prompts, ids.prompt_ids, ids.num_prompts) == ([], [[1, 2, 3]], 1)
    assert (lists.prompts, lists.prompt_ids, lists.num_prompts) == ([], [[1], [2, 3]], 2)
    for form in (ids, lists, one, many):
        check_completion(form)
    for mixed in (b'{"prompt": ["a", 1]}', b'{"prompt": [[1], 2]}'):
        with pytest.raises(ApiError) as info:
            check_completion(decode_body(mixed, CompletionRequest))
        assert info.value.param == "prompt" and "mix" in info.value.message
    with pytest.raises(ApiError) as info:
        check_completion(decode_body(b'{"prompt": [' + b",".join([b"[1]"] * 257) + b']}',
                                     CompletionRequest))
    assert info.value.param == "prompt" and "257" in info.value.message
    # A flat list of ids is one prompt, however long.
    check_completion(decode_body(b'{"prompt": [' + b",".join([b"1"] * 5000) + b']}',
                                 CompletionRequest))
    assert sampling_params(one, None, "max_tokens", 128).stop == ["\n"]
    assert sampling_params(many, None, "max_tokens", 128).stop == ["x"]


def test_sampling_defaults_and_limits() -> None:
    req = decode_body(b'{"prompt": "a", "top_k": 0, "seed": 7, "min_tokens": 2}',
                      CompletionRequest)
    params = sampling_params(req, None, "max_tokens", 128)
    # An omitted max_tokens is the rest of the context, resolved by the daemon per prompt.
    assert (params.max_tokens, params.top_k, params.seed, params.temperature) == (None, -1, 7, 1.0)
    with pytest.raises(ApiError) as info:
        sampling_params(req, 1, "max_tokens", 128)
    assert info.value.param == "min_tokens"
    with pytest.raises(ApiError) as info:
        sampling_params(req, 500, "max_completion_tokens", 128)
    assert info.value.param == "max_completion_tokens" and "128" in info.value.message


def test_unsupported_options_are_refused_not_ignored() -> None:
    for body, param in ((b'{"prompt": "a", "suffix": "z"}', "suffix"),
                        (b'{"prompt": "a", "best_of": 2}', "best_of")):
        with pytest.raises(ApiError) as info:
            check_completion(decode_body(body, CompletionRequest))
        assert info.value.param == param
    with pytest.raises(ApiError) as info:
        check_chat(decode_body(b'{"messages": [{"role": "user", "content": "a"}], "stream": true, '
                               b'"stream_options": {"continuous_usage_stats": true}}', ChatRequest))
    assert info.value.param == "stream_options.continuous_usage_stats"


def test_sampling_fields_reach_the_daemon() -> None:
    req = decode_body(b'{"prompt": "a", "echo": true, "presence_penalty": 1.5, '
                      b'"frequency_penalty": -0.5, "repetition_penalty": 1.3, "min_p": 0.2, '
                      b'"logit_bias": {"65": -100, "66": 7.5}, "bad_words": ["no"], '
                      b'"stop_token_ids": [3]}', CompletionRequest)
    check_completion(req)
    p = sampling_params(req, 5, "max_tokens", 128)
    assert (p.echo, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (
        True, 1.5, -0.5, 1.3, 0.2)
    assert (p.logit_bias, p.bad_words, p.stop_token_ids) == ({65: -100.0, 66: 7.5}, ["no"], [3])
    neutral = sampling_params(decode_body(b'{"prompt": "a"}', CompletionRequest), 5, "max_tokens",
                              128)
    assert (neutral.presence_penalty, neutral.repetition_penalty, neutral.min_p,
            neutral.logit_bias, neutral.echo) == (0.0, 1.0, 0.0, {}, False)


@pytest.mark.parametrize(("body", "param"), [
    (b'"presence_penalty": 2.5', "presence_penalty"),
    (b'"frequency_penalty": -3', "frequency_penalty"),
    (b'"repetition_penalty": 0', "repetition_penalty"),
    (b'"min_p": 1.5', "min_p"),
    (b'"logit_bias": {"1": 101}', "logit_bias"),
    (b'"logit_bias": {"one": 1}', "logit_bias"),
    (b'"bad_words": [""]', "bad_words[0]"),
    (b'"stop_token_ids": [-1]', "stop_token_ids[0]"),
])
def test_sampling_field_limits_name_the_field(body: bytes, param: str) -> None:
    for struct_type, head in ((CompletionRequest, b'{"prompt": "a", '),
                              (ChatRequest, b'{"messages": [{"role": "user", "content": "a"}], ')):
        assert error_of(head + body + b"}", struct_type).param == param


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
