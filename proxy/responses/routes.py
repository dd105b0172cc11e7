"""The OpenAI Responses API: create, retrieve, delete and cancel responses.

A foreground response is tied to its HTTP request: when the client leaves, the engine session
is aborted (and the daemon drops the placeholder). A background response runs in a proxy task
that no client owns (see `proxy.responses.background`); only a cancel or a DELETE stops it.
The daemon owns the store; GET / DELETE / cancel go to it as ResponseOp records, except that a
background response this proxy still follows answers from its live state, and from it too when
the daemon has no row for it yet (it has not admitted the Submit). One whose run lost sight of
the engine answers from the store. A DELETE ends a background response wherever it is: an Abort
goes ahead of it on the control pipe, so that a Submit still queued here or in the pipe is
refused when it arrives, and one the daemon holds is cancelled before its row goes.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ipc.reasons import Reason
from ipc.records import AbortCause
from ipc.response_records import (
    ItemsPage,
    ResponseCancel,
    ResponseDelete,
    ResponseGet,
    ResponseInputItems,
    ResponseReply,
    ResponseStatus,
)
from proxy.bodies import check_response_id, client_request_id, new_id
from proxy.engine.batching import Batch
from proxy.engine.client import EngineClient, unavailable
from proxy.engine.exchange import exchange
from proxy.engine.metrics import RequestTimer
from proxy.http.errors import ApiError, refused
from proxy.http.sse import SSEResponse, sse_event
from proxy.http.tenancy import who
from proxy.openai.completions import served_model, served_models
from proxy.options import ProxyOptions
from proxy.responses.background import BackgroundRegistry, BackgroundRun
from proxy.responses.events import Event, Outcome, ResponseEvents, apply_record, stored_object
from proxy.responses.input_items import MAX_ITEM_ID, listed_items
from proxy.responses.item_references import resolve_references
from proxy.responses.request import (
    build_submit,
    decode_request,
    parse_request,
    response_params,
    sampling_params,
    tool_use,
)
from proxy.responses.response_object import deleted_object
from proxy.tool_calls import call_ids


def background_registry(app: Starlette) -> BackgroundRegistry:
    registry: BackgroundRegistry | None = getattr(app.state, "background_responses", None)
    if registry is None:
        options: ProxyOptions = app.state.options
        registry = app.state.background_responses = BackgroundRegistry(
            max_history_bytes=options.background_history_bytes)
    return registry


def release_background(app: Starlette) -> None:
    """The proxy stops: background responses go on in the daemon; their readers here are let go."""
    registry: BackgroundRegistry | None = getattr(app.state, "background_responses", None)
    if registry is not None:
        registry.release_all()


async def close_background(app: Starlette) -> None:
    """For the app's shutdown: every background run released, and its task awaited."""
    registry: BackgroundRegistry | None = getattr(app.state, "background_responses", None)
    if registry is not None:
        await registry.close()


def _engine(request: Request) -> EngineClient:
    engine: EngineClient = request.app.state.engine
    return engine


# --- POST /v1/responses ---------------------------------------------------------------------


async def create_response(request: Request) -> Response:
    t_submit = time.monotonic()
    client_id = client_request_id(request.headers.get("x-request-id"))
    rid = request.state.request_id = new_id("resp_")  # response ids are the server's own
    body = await request.body()
    req, items = parse_request(body, served_models(request))
    engine = _engine(request)
    # Refused before any item reference costs the store a lookup.
    use = tool_use(req, engine.single_tool_call)
    caller = who(request)
    decoded = decode_request(body, req, await resolve_references(engine, items, caller))
    if not engine.up:
        raise unavailable(engine.down_reason)
    registry = background_registry(request.app)
    sampling = sampling_params(req, engine.max_model_len, engine.generation_defaults)
    params = response_params(decoded, rid, served_model(request), sampling,
                             engine.single_tool_call)
    fmt = engine.tool_call_format
    submit = build_submit(decoded, params, sampling, t_submit, client_id, use, fmt,
                          caller.tenant)
    events = (ResponseEvents(params, use.parser(fmt, call_ids(fmt, rid)), use.custom) if use
              else ResponseEvents(params))
    timer = RequestTimer(request.app.state.metrics, "responses", t_submit)
    if not req.background:
        return await exchange(request, submit, ResponseAnswer(events), req.stream, timer)
    run = BackgroundRun(events)
    registry.add(run)
    run.start(engine, submit, timer)
    if req.stream:
        return SSEResponse(_sse(run.subscribe()))
    return JSONResponse(events.snapshot())


class ResponseAnswer:
    """A foreground response's answer: the Response object once it ended, or its stream (the
    opening events with the first batch, then each batch's events together: one write)."""

    __slots__ = ("events", "opened")

    def __init__(self, events: ResponseEvents) -> None:
        self.events = events
        self.opened = False

    @property
    def ok(self) -> bool:
        return self.events.finished  # ended by the engine's Finish

    def _opening(self) -> list[Event]:
        if self.opened:
            return []
        self.opened = True
        return self.events.created()

    def render(self, batch: Batch) -> tuple[bytes, bool]:
        out = self._opening()
        for record in batch:
            out += apply_record(self.events, record)
        return _sse_bytes(out), self.ok

    def error(self, exc: ApiError) -> bytes:
        """The daemon was lost mid-stream: the response fails."""
        events = self.events
        out = self._opening() + events.error(exc.message, exc.code, exc.param)
        out += events.finish(Outcome(ResponseStatus.FAILED, error=exc.message))
        return _sse_bytes(out)

    def collect(self, batch: Batch) -> None:
        for record in batch:
            apply_record(self.events, record)

    def body(self) -> dict[str, Any]:
        return self.events.snapshot()


def _sse_bytes(events: list[Event]) -> bytes:
    return b"".join([sse_event(event, event["type"]) for event in events])


async def _sse(batches: AsyncGenerator[list[Event], None]) -> AsyncGenerator[bytes, None]:
    async with contextlib.aclosing(batches):
        async for events in batches:
            if events:
                yield _sse_bytes(events)


# --- GET / DELETE / cancel ------------------------------------------------------------------


def _reply(reply: ResponseReply, rid: str, run: BackgroundRun | None = None) -> Response:
    """The daemon's answer about response `rid`: the stored response, its deletion or an
    error."""
    if reply.reason is None and reply.deleted:
        return JSONResponse(deleted_object(rid))
    if reply.reason is None:
        stored = reply.response
        return JSONResponse(None if stored is None else stored_object(stored))
    raise refused(reply.reason, reply.message or "response operation failed", reply.param)


async def get_response(request: Request) -> Response:
    rid = check_response_id(request.path_params["response_id"])
    run = background_registry(request.app).get(rid)
    starting_after = _int_param(request.query_params.get("starting_after"), "starting_after",
                                default=-1, low=-1, high=2**31)
    if _bool_param(request.query_params.get("stream"), "stream"):
        if run is None:
            reply = await _engine(request).response_op(ResponseGet(rid), who=who(request))
            if reply.reason is not None:
                return _reply(reply, rid)  # 404 for what does not exist, or no longer does
            raise ApiError(400, f"response {rid!r} cannot be streamed: only a background "
                           "response still held by this server can", param="stream")
        return SSEResponse(_sse(run.subscribe(starting_after)))
    if run is not None and not run.finished and not run.interrupted:
        # Live state, with the text so far; the daemon's placeholder has no output yet.
        return JSONResponse(run.events.snapshot())
    try:
        reply = await _engine(request).response_op(ResponseGet(rid), who=who(request))
    except ApiError:
        if run is None or run.interrupted:
            raise
        return JSONResponse(run.events.snapshot())  # the daemon is down; this proxy knows
    if reply.reason is Reason.NOT_FOUND and run is not None:
        return JSONResponse(run.events.snapshot())
    return _reply(reply, rid, run)


async def delete_response(request: Request) -> Response:
    rid = check_response_id(request.path_params["response_id"])
    registry = background_registry(request.app)
    engine = _engine(request)
    run = registry.get(rid)
    if run is not None and not run.finished:
        engine.abort(rid, AbortCause.CANCEL)  # ahead of the DELETE: see the module's docstring
    reply = await engine.response_op(ResponseDelete(rid), who=who(request))
    if run is not None and reply.reason in (None, Reason.NOT_FOUND):
        run.end(Outcome(ResponseStatus.CANCELLED))
        registry.remove(rid)
        return JSONResponse(deleted_object(rid))
    return _reply(reply, rid)


async def cancel_response(request: Request) -> Response:
    """Cancel a background response: the store marks it cancelled first, so however the race
    with its last tokens goes it stays cancelled; then the Abort stops the engine."""
    rid = check_response_id(request.path_params["response_id"])
    engine = _engine(request)
    run = background_registry(request.app).get(rid)
    live = run is not None and not run.finished
    reply = await engine.response_op(ResponseCancel(rid), who=who(request))
    if reply.reason is None or (live and reply.reason is Reason.NOT_FOUND):
        engine.abort(rid, AbortCause.CANCEL)
    if run is not None and live and reply.reason in (None, Reason.NOT_FOUND):
        run.end(Outcome(ResponseStatus.CANCELLED))
        if reply.reason is Reason.NOT_FOUND:  # queued in the daemon, not admitted: no row yet
            return JSONResponse(run.events.snapshot())
    return _reply(reply, rid, run)


async def list_input_items(request: Request) -> Response:
    """A stored response's input items, paged like OpenAI's lists (newest first by default): the
    daemon sends the page asked for, never every item."""
    rid = check_response_id(request.path_params["response_id"])
    page = items_page(request.query_params, f"no input item of response {rid!r}")
    reply = await _engine(request).response_op(ResponseInputItems(rid, page),
                                               who=who(request))
    if reply.reason is not None or reply.input_items is None:
        return _reply(reply, rid)
    return item_list(reply)


def items_page(query: Mapping[str, str], unknown: str) -> ItemsPage:
    """OpenAI's list parameters (limit, order, after); ``unknown`` says what a too long
    ``after`` names."""
    limit = _int_param(query.get("limit"), "limit", default=20, low=1, high=100)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"'order' must be 'asc' or 'desc', got {order!r}", param="order")
    after = query.get("after")
    if after is not None and len(after) > MAX_ITEM_ID:
        raise ApiError(400, f"'after' names {unknown}: item ids are at most {MAX_ITEM_ID} "
                       "characters", param="after")
    return ItemsPage(limit, "asc" if order == "asc" else "desc", after)


def item_list(reply: ResponseReply) -> Response:
    """A page of stored items (ResponseReply.input_items) as OpenAI's list object (its items
    copied as stored, not decoded: proxy/responses/input_items.py `listed_items`)."""
    ids = reply.item_ids
    data = msgspec.Raw(listed_items(reply.input_items or "[]", ids))
    return Response(msgspec.json.encode({
        "object": "list", "data": data, "first_id": ids[0] if ids else None,
        "last_id": ids[-1] if ids else None, "has_more": reply.has_more}),
        media_type="application/json")


def _int_param(raw: str | None, name: str, default: int, low: int, high: int) -> int:
    if raw is None:
        return default
    # Digits only: int() would also take " 5", "5_0" and "+5", which no client means.
    value = int(raw) if _INTEGER.match(raw) and len(raw) <= 12 else low - 1
    if not low <= value <= high:
        raise ApiError(400, f"'{name}' must be an integer from {low} to {high}, got {raw!r}",
                       param=name)
    return value


def _bool_param(raw: str | None, name: str) -> bool:
    if raw is None or raw.lower() == "false":
        return False
    if raw.lower() == "true":
        return True
    raise ApiError(400, f"'{name}' must be true or false, got {raw!r}", param=name)


_INTEGER = re.compile(r"^-?[0-9]+$")

routes = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
]
