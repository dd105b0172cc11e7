"""``GET /openapi.json``: the API as an OpenAPI 3.1 document.

Request bodies come from the very msgspec types the handlers decode with, so the document cannot
drift from the validation. Answers are built as plain dicts by the handlers; the types of
proxy/answer_types.py describe them, and tests/proxy/test_openapi.py checks real answers against
this document (and the fuzzing in tests/e2e/test_fuzz_http.py checks every answer it provokes).
"""

from __future__ import annotations

import functools

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from proxy.answer_types import (
    JSON,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    Conversation,
    DeletedConversation,
    DeletedResponse,
    ErrorBody,
    Health,
    InputItem,
    InputItemList,
    ModelList,
    ResponseEvent,
    ResponseObject,
)
from proxy.anthropic.answer_types import AnthropicError, MessageEvent, MessageObject, TokenCount
from proxy.anthropic.request import CountTokensRequest, MessagesRequest
from proxy.bodies import REQUEST_ID_PATTERN
from proxy.openai.schemas import ChatRequest, CompletionRequest
from proxy.openai.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from proxy.responses.conversations import AddItems, CreateConversation, UpdateConversation
from proxy.responses.request import CreateResponse

_TYPES = (CompletionRequest, ChatRequest, CreateResponse, ErrorBody, Completion, ChatCompletion,
          CompletionChunk, ChatCompletionChunk, ResponseEvent, ResponseObject, DeletedResponse,
          InputItemList, ModelList, Health, TokenizeRequest, TokenizeResponse, DetokenizeRequest,
          DetokenizeResponse, CreateConversation, UpdateConversation, AddItems, Conversation,
          DeletedConversation, InputItem, MessagesRequest, CountTokensRequest, MessageObject,
          MessageEvent, AnthropicError, TokenCount)
_ERRORS = {"400": "invalid input, named in error.param", "401": "missing or wrong API key",
           "529": "overloaded: too many requests waiting, or the engine unavailable (Anthropic's "
                  "status, on /v1/messages)",
           "404": "unknown model or response", "413": "request body too large",
           "429": "too many requests waiting", "500": "the engine or the store failed",
           "503": "the engine is unavailable or the server is stopping",
           "504": "the engine did not take the request within the request timeout"}
_RESPONSE_ID = {"name": "response_id", "in": "path", "required": True,
                "schema": {"type": "string", "pattern": REQUEST_ID_PATTERN}}
_REQUEST_ID = {"name": "X-Request-Id", "in": "header", "required": False,
               "description": "the client's id for this request: echoed back and logged, never "
               "the object's id (a fresh one is echoed when absent)",
               "schema": {"type": "string", "pattern": REQUEST_ID_PATTERN}}


def _ref(name: str) -> JSON:
    return {"$ref": f"#/components/schemas/{name}"}


def _sse_event(*payloads: str) -> JSON:
    """One server-sent event: its data is JSON of one of `payloads`, or the literal [DONE]."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(p) for p in payloads]}}
    return {"type": "object", "required": ["data"],
            "properties": {"event": {"type": "string"},
                           "data": {"anyOf": [{"const": "[DONE]"}, json_data]}}}


def _answers(ok: str | None, *, stream: tuple[str, ...] = (),
             errors: tuple[str, ...] = tuple(_ERRORS), ok_type: str = "application/json",
             error_body: str = "ErrorBody") -> JSON:
    content: JSON = {ok_type: {"schema": _ref(ok) if ok else {"type": "string"}}}
    if stream:
        content["text/event-stream"] = {"schema": _sse_event(*stream)}
    out: JSON = {"200": {"description": "success", "content": content}}
    for code in errors:
        out[code] = {"description": _ERRORS[code],
                     "content": {"application/json": {"schema": _ref(error_body)}}}
    return out


def _operation(summary: str, answers: JSON, body: str | None = None,
               parameters: list[JSON] | None = None) -> JSON:
    op: JSON = {"summary": summary, "responses": answers}
    if body is not None:
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": _ref(body)}}}
    if parameters:
        op["parameters"] = parameters
    return op


def _query(name: str, schema: JSON) -> JSON:
    return {"name": name, "in": "query", "required": False, "schema": schema}


_CONVERSATION_ID = {**_RESPONSE_ID, "name": "conversation_id"}
_ITEM_ID = {"name": "item_id", "in": "path", "required": True,
            "schema": {"type": "string", "maxLength": 64}}


def _conversation_paths(lookup: tuple[str, ...]) -> JSON:
    one, item = [_CONVERSATION_ID], [_CONVERSATION_ID, _ITEM_ID]
    page = [_query("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
            _query("order", {"enum": ["asc", "desc"]}), _query("after", {"type": "string"})]
    return {
        "/v1/conversations": {"post": _operation(
            "Create a conversation, maybe with items", _answers("Conversation", errors=lookup),
            "CreateConversation")},
        "/v1/conversations/{conversation_id}": {
            "get": _operation("Retrieve a conversation", _answers("Conversation", errors=lookup),
                              parameters=one),
            "post": _operation("Update a conversation's metadata",
                               _answers("Conversation", errors=lookup), "UpdateConversation",
                               parameters=one),
            "delete": _operation("Delete a conversation and its items",
                                 _answers("DeletedConversation", errors=lookup),
                                 parameters=one)},
        "/v1/conversations/{conversation_id}/items": {
            "get": _operation("List a conversation's items",
                              _answers("InputItemList", errors=lookup), parameters=one + page),
            "post": _operation("Add items to a conversation",
                               _answers("InputItemList", errors=lookup), "AddItems",
                               parameters=one)},
        "/v1/conversations/{conversation_id}/items/{item_id}": {
            "get": _operation("Retrieve an item", _answers("InputItem", errors=lookup),
                              parameters=item),
            "delete": _operation("Delete an item; answers with the conversation",
                                 _answers("Conversation", errors=lookup), parameters=item)},
    }


def _paths() -> JSON:
    generate = ("400", "401", "404", "413", "429", "500", "503")
    lookup = ("400", "401", "404", "500", "503")
    anthropic = ("400", "401", "404", "413", "500", "504", "529")
    return {
        **_conversation_paths(lookup),
        "/v1/messages": {"post": _operation(
            "Create a message, Anthropic's Messages API (SSE when stream is true)", _answers(
                "MessageObject", stream=("MessageEvent", "AnthropicError"), errors=anthropic,
                error_body="AnthropicError"), "MessagesRequest", [_REQUEST_ID])},
        "/v1/messages/count_tokens": {"post": _operation(
            "Count a message's prompt tokens (Anthropic's)", _answers(
                "TokenCount", errors=anthropic, error_body="AnthropicError"),
            "CountTokensRequest")},
        "/v1/completions": {"post": _operation(
            "Create a completion (SSE when stream is true)", _answers(
                "Completion", stream=("CompletionChunk", "ErrorBody"), errors=generate),
            "CompletionRequest", [_REQUEST_ID])},
        "/v1/chat/completions": {"post": _operation(
            "Create a chat completion (SSE when stream is true)",
            _answers("ChatCompletion", stream=("ChatCompletionChunk", "ErrorBody"),
                     errors=generate), "ChatRequest",
            [_REQUEST_ID])},
        "/v1/responses": {"post": _operation(
            "Create a response (SSE when stream is true)",
            _answers("ResponseObject", stream=("ResponseEvent",), errors=generate), "CreateResponse",
            [_REQUEST_ID])},
        "/v1/responses/{response_id}": {
            "get": _operation("Retrieve a response (a live background one as SSE with stream)",
                              _answers("ResponseObject", stream=("ResponseEvent",), errors=lookup),
                              parameters=[_RESPONSE_ID, _query("stream", {"type": "boolean"}),
                                          _query("starting_after", {"type": "integer", "minimum": -1})]),
            "delete": _operation("Delete a stored response",
                                 _answers("DeletedResponse", errors=lookup),
                                 parameters=[_RESPONSE_ID])},
        "/v1/responses/{response_id}/cancel": {"post": _operation(
            "Cancel a background response", _answers("ResponseObject", errors=lookup),
            parameters=[_RESPONSE_ID])},
        "/v1/responses/{response_id}/input_items": {"get": _operation(
            "List a stored response's input items", _answers("InputItemList", errors=lookup),
            parameters=[_RESPONSE_ID,
                        _query("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
                        _query("order", {"enum": ["asc", "desc"]}),
                        _query("after", {"type": "string"})])},
        "/v1/models": {"get": _operation("The served model", _answers("ModelList", errors=(
            "401",)))},
        "/v1/models/{model}": {"get": _operation(
            "One model (404 for an id not served)", _answers("ModelCard", errors=("401", "404")),
            parameters=[{"name": "model", "in": "path", "required": True,
                         "schema": {"type": "string", "minLength": 1, "maxLength": 256}}])},
        "/tokenize": {"post": _operation(
            "Token ids of a prompt, or of chat messages rendered by the chat template (vLLM's)",
            _answers("TokenizeResponse", errors=lookup), "TokenizeRequest")},
        "/detokenize": {"post": _operation(
            "The text of token ids (vLLM's)", _answers("DetokenizeResponse", errors=lookup),
            "DetokenizeRequest")},
        "/health": {"get": _operation("Whether the engine is up", {
            "200": {"description": "up", "content": {"application/json": {
                "schema": _ref("Health")}}},
            "503": {"description": "the engine is unavailable", "content": {
                "application/json": {"schema": _ref("Health")}}}})},
        "/metrics": {"get": _operation("Prometheus metrics", _answers(
            None, errors=(), ok_type="text/plain"))},
        "/openapi.json": {"get": _operation("This document", {"200": {
            "description": "OpenAPI 3.1", "content": {"application/json": {
                "schema": {"type": "object"}}}}})},
    }


@functools.cache
def document() -> JSON:
    _, schemas = msgspec.json.schema_components(_TYPES,
                                                ref_template="#/components/schemas/{name}")
    return {
        "openapi": "3.1.0",
        "info": {"title": "tether", "version": "0.1.0",
                 "description": "An OpenAI-compatible LLM server that stops work the moment a "
                                "client goes away."},
        "paths": _paths(),
        "components": {"schemas": schemas, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "required only when the server has --api-key"}}},
        "security": [{}, {"bearer": []}],
    }


async def openapi_json(request: Request) -> Response:
    return JSONResponse(document())
