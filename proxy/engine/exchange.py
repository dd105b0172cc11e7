"""One request's exchange with the engine, the same for completions, chat and foreground
Responses: queue the Submit -> wait for the daemon's first record while watching the client (so a
rejection still gets its HTTP status, and a queued request whose client leaves is aborted) ->
stream it or collect it, still watching -> finish. An endpoint only says how its answer looks
(an `Answer`); leaving early, however it happens, closes the session, which writes the Abort.
Who calls the ASGI ``send`` of a stream, and on which task: proxy/engine/token_stream.py.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response

from ipc.records import Submit
from proxy.engine.batching import Batch
from proxy.engine.client import EngineClient
from proxy.engine.metrics import RequestTimer
from proxy.engine.token_stream import Keepalive, StreamAnswer, TokenStream
from proxy.http.cancellation import DisconnectWatch


class Answer(StreamAnswer, Protocol):
    """How one endpoint renders what the engine produced for a request, streamed or not."""

    def collect(self, batch: Batch) -> None:
        """Take a batch into the answer of a request that does not stream."""

    def body(self) -> dict[str, Any]:
        """The whole answer of a request that does not stream."""


async def exchange(request: Request, submit: Submit, answer: Answer, stream: bool,
                   timer: RequestTimer, keepalive: Keepalive | None = None) -> Response:
    engine: EngineClient = request.app.state.engine
    session = engine.open_session(submit)
    # One watcher for the whole request: while queued, while collecting, while streaming.
    watch = DisconnectWatch(request.receive)
    streaming = False
    try:
        with watch:
            first = await session.next_batch()
        if stream:
            streaming = True  # from here the response closes the watch and the session
            return TokenStream(engine, session, answer, timer, first or [], watch, keepalive)
        with watch:
            batch = first
            while batch is not None:
                timer.see(batch)
                answer.collect(batch)
                batch = await session.next_batch()
        timer.done()
        # orjson: a collected choice's log-probabilities come pre-rendered (proxy/engine/collected.py).
        return Response(orjson.dumps(answer.body()), media_type="application/json")
    finally:
        if not streaming:
            watch.close()
            engine.close_session(session)
