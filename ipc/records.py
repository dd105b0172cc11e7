"""Typed wire records shared by the proxy and the daemon.

Every record is a msgspec Struct tagged by its kind; the tag is the wire value of `Kind`.
Which pipe carries which records:

- ``requests`` (proxy -> daemon): Submit
- ``control``  (proxy -> daemon): Hello, Heartbeat, Goodbye, Abort, ResponseOp
- ``tokens``   (daemon -> proxy): Welcome, Delta, Finish, Error, Stats, ResponseReply
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec

PROTOCOL_VERSION = 3  # 3: logprob tokens travel as bytes

# Every control record must fit in PIPE_BUF so that one write() is atomic.
PIPE_BUF = 4096

# Liveness. A process that dies is noticed at once (EOF, EPIPE, ENXIO); silence only catches one
# that hangs alive. The bound is seconds, not one: on a busy 2-core machine a long prefill tick
# or a starved event loop can go quiet for over a second, and a false "lost" aborts every session.
HEARTBEAT_INTERVAL_S = 0.25  # proxy -> daemon on control; the daemon sends Stats every 100 ms
SILENCE_TIMEOUT_S = 3.0


class Kind(enum.StrEnum):
    SUBMIT = "submit"
    HELLO = "hello"
    HEARTBEAT = "hb"
    GOODBYE = "bye"
    ABORT = "abort"
    RESPONSE_OP = "rop"
    WELCOME = "welcome"
    DELTA = "delta"
    FINISH = "finish"
    ERROR = "error"
    STATS = "stats"
    RESPONSE_REPLY = "rreply"


class RequestKind(enum.StrEnum):
    COMPLETION = "completion"
    CHAT = "chat"
    RESPONSE = "response"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class AbortCause(enum.StrEnum):
    CLIENT_DISCONNECT = "client_disconnect"
    CANCEL = "cancel"
    PROXY_LOST = "proxy_lost"
    SHUTDOWN = "shutdown"
    TIMEOUT = "timeout"


class ResponseOpKind(enum.StrEnum):
    GET = "get"
    DELETE = "delete"
    CANCEL = "cancel"
    INPUT_ITEMS = "input_items"


NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
MAX_LOGPROBS = 20  # alternatives per token, as vLLM allows


class Message(msgspec.Struct, frozen=True):
    role: str
    content: str


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: PosInt = 16
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1)] = -1  # -1: no top-k (the OpenAI/vLLM convention)
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    # Log-probabilities of the sampled tokens with this many alternatives each; None: none.
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None


class ResponseFields(msgspec.Struct, frozen=True):
    """Responses-API state carried by a Submit of kind RESPONSE; the daemon owns the store."""

    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    instructions: str | None = None
    # The request's input items as sent by the client (kept verbatim in the store).
    input_items: list[dict[str, Any]] = []
    # Echoed into the stored response object.
    created_at: int = 0
    model: str = ""


# --- proxy -> daemon: requests pipe -------------------------------------------------------------


class Submit(msgspec.Struct, tag=Kind.SUBMIT.value, tag_field="k"):
    """One HTTP request = one engine session.

    Sequences are ``len(prompts) * n`` (completions) or ``n`` (chat, responses); sequence
    index ``i`` is prompt ``i // n``, sample ``i % n`` as OpenAI numbers choices.
    For RESPONSE, ``rid`` is the response id.
    """

    rid: str
    epoch: int
    kind: RequestKind
    sampling: SamplingParams
    n: PosInt = 1
    prompts: list[str] = []
    messages: list[Message] = []
    response: ResponseFields | None = None
    t_submit: float = 0.0  # proxy monotonic time when the HTTP request arrived


# --- proxy -> daemon: control pipe --------------------------------------------------------------


class Hello(msgspec.Struct, tag=Kind.HELLO.value, tag_field="k"):
    version: int
    pid: int
    epoch: int


class Heartbeat(msgspec.Struct, tag=Kind.HEARTBEAT.value, tag_field="k"):
    epoch: int
    t: float


class Goodbye(msgspec.Struct, tag=Kind.GOODBYE.value, tag_field="k"):
    epoch: int


class Abort(msgspec.Struct, tag=Kind.ABORT.value, tag_field="k"):
    rid: str
    cause: AbortCause
    epoch: int
    # Proxy monotonic time at which it saw the disconnect (CLOCK_MONOTONIC is system-wide).
    t_disconnect: float | None = None


class ResponseOp(msgspec.Struct, tag=Kind.RESPONSE_OP.value, tag_field="k"):
    """GET / DELETE / cancel of a stored response; answered by a ResponseReply with ``op_id``."""

    op_id: str
    op: ResponseOpKind
    response_id: str
    epoch: int


# --- daemon -> proxy: tokens pipe ---------------------------------------------------------------


class Welcome(msgspec.Struct, tag=Kind.WELCOME.value, tag_field="k"):
    version: int
    pid: int
    model: str
    max_model_len: int
    epoch: int  # the proxy epoch this daemon has accepted


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    """A sampled token's log-probability under the model, and the most likely tokens there.

    ``token`` is the token's own bytes as they extend the text (a token can hold part of a UTF-8
    character; the proxy renders the text); ``top`` holds (bytes, logprob) pairs, most likely
    first."""

    token: bytes
    logprob: float
    top: list[tuple[bytes, float]] = []


class Delta(msgspec.Struct, tag=Kind.DELTA.value, tag_field="k", omit_defaults=True):
    rid: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Finish(msgspec.Struct, tag=Kind.FINISH.value, tag_field="k"):
    """The end of one sequence; a session ends when every index has finished."""

    rid: str
    index: int
    reason: FinishReason
    usage: Usage
    cause: AbortCause | None = None  # set when reason is ABORT
    message: str | None = None  # set when reason is ERROR


class Error(msgspec.Struct, tag=Kind.ERROR.value, tag_field="k"):
    """A rejected Submit (the whole session) or, with rid None, a daemon-wide problem."""

    rid: str | None
    message: str
    status: int = 400
    param: str | None = None
    code: str | None = None


class Stats(msgspec.Struct, tag=Kind.STATS.value, tag_field="k"):
    """Engine figures for /metrics: gauges are current, counters cumulative since start,
    ``*_obs`` lists are observations since the previous Stats record."""

    t: float
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    placeholders: int
    ticks: int
    prompt_tokens: int
    generation_tokens: int
    tokens_after_disconnect: int
    aborts: dict[str, int]
    finished: dict[str, int]
    bad_records: dict[str, int]
    abort_latency_obs: list[float] = []
    abort_latency_ticks_obs: list[int] = []
    kv_blocks_cached: int = 0  # held by no session, kept for the prefix cache (free to take)
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens found there


class ResponseReply(msgspec.Struct, tag=Kind.RESPONSE_REPLY.value, tag_field="k"):
    op_id: str
    status: int  # HTTP status the proxy should answer with
    body: dict[str, Any] | None = None
    message: str | None = None


ToDaemon = Submit | Hello | Heartbeat | Goodbye | Abort | ResponseOp
ToProxy = Welcome | Delta | Finish | Error | Stats | ResponseReply
Record = ToDaemon | ToProxy
