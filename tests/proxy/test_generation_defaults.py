"""Sampling fields a request omits take the model's defaults (the Welcome's), else the API's."""

from __future__ import annotations

from ipc.records import GenerationDefaults
from proxy.bodies import decode_body
from proxy.openai.schemas import ChatRequest, sampling_params
from proxy.responses.request import CreateResponse
from proxy.responses.request import sampling_params as response_sampling

MODEL = GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                           repetition_penalty=1.1)


def chat(body: bytes) -> ChatRequest:
    return decode_body(body, ChatRequest)


def test_omitted_fields_take_the_models_defaults() -> None:
    req = chat(b'{"messages": [{"role": "user", "content": "hi"}]}')
    p = sampling_params(req, None, "max_tokens", 128, MODEL)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        0.6, 0.9, 20, 0.05, 1.1)
    r = response_sampling(decode_body(b'{"input": "hi"}', CreateResponse), 128, MODEL)
    assert (r.temperature, r.top_p, r.top_k, r.min_p, r.repetition_penalty) == (
        0.6, 0.9, 20, 0.05, 1.1)


def test_given_fields_win_even_when_they_are_the_apis_defaults() -> None:
    req = chat(b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, '
               b'"top_p": 1.0, "top_k": 0, "min_p": 0, "repetition_penalty": 1.0}')
    p = sampling_params(req, None, "max_tokens", 128, MODEL)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        1.0, 1.0, -1, 0.0, 1.0)


def test_without_model_defaults_the_apis_hold() -> None:
    p = sampling_params(chat(b'{"messages": [{"role": "user", "content": "hi"}]}'), None,
                        "max_tokens", 128, GenerationDefaults())
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        1.0, 1.0, -1, 0.0, 1.0)
