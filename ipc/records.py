"""Typed wire records shared by the proxy and the daemon: a session's, and what they carry.

Every record is a msgspec Struct tagged by its kind; the tag is the wire value of `Kind`. The
records of the Responses store are in ipc/response_records.py, the engine's figures in
ipc/stats.py, and ipc/wire.py says which pipe carries which.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from ipc.reasons import Reason

# What each version changed: docs/architecture.md, "The protocol's versions". A proxy and a
# daemon of different versions refuse each other at Hello.
PROTOCOL_VERSION = 20

# Every control record must fit in PIPE_BUF so that one write() is atomic.
PIPE_BUF = 4096

# Liveness. A process that dies is noticed at once (EOF, EPIPE, ENXIO); silence only catches one
# that hangs alive. The bound is seconds, not one: on a busy 2-core machine a starved event loop
# can go quiet for over a second, and a false "lost" aborts every session. The daemon's records
# come from a thread of their own while a forward pass runs, so a long tick is never silence.
HEARTBEAT_INTERVAL_S = 0.25  # proxy -> daemon on control; daemon -> proxy Stats or Alive
SILENCE_TIMEOUT_S = 3.0


def version_mismatch(daemon: int, proxy: int) -> str:
    """The one wording both sides use, naming both versions."""
    return (f"protocol version mismatch: daemon {daemon}, proxy {proxy}; "
            "run a daemon and a proxy of the same release")


class Kind(enum.StrEnum):
    SUBMIT = "submit"
    HELLO = "hello"
    HEARTBEAT = "hb"
    GOODBYE = "bye"
    ABORT = "abort"
    PAUSE = "pause"
    RESUME = "resume"
    RESPONSE_OP = "rop"
    WELCOME = "welcome"
    ADMITTED = "admitted"
    ALIVE = "alive"
    DELTA = "delta"
    FINISH = "finish"
    ERROR = "error"
    STATS = "stats"
    RESPONSE_REPLY = "rreply"


class RequestKind(enum.StrEnum):
    COMPLETION = "completion"
    CHAT = "chat"
    RESPONSE = "response"
    # Answered at once, without the model: one Delta (ids, or text) and its Finish.
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"


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


NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
MAX_LOGPROBS = 20  # alternatives per token, as vLLM allows
ECHO_TOKENS = 512  # prompt log-probabilities per Delta: a frame stays far below its limit


class ToolCall(msgspec.Struct, frozen=True):
    """A function call an assistant turn made, as a later turn's history carries it."""

    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class Message(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str
    content: str | None  # None: an assistant turn that only calls tools
    tool_calls: list[ToolCall] = []
    tool_call_id: str | None = None  # a tool turn: the call it answers


class ToolFunction(msgspec.Struct, frozen=True, omit_defaults=True):
    """A function the model may call, as the chat template is given it."""

    name: str
    description: str | None = None
    parameters: str | None = None  # the JSON schema of its arguments, as JSON text


class ToolCallFormat(enum.StrEnum):
    """How a chat template has the model write its tool calls (the parsers' names as vLLM's
    --tool-call-parser spells them)."""

    HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": ...}</tool_call> (Qwen, Hermes)
    LLAMA3_JSON = "llama3_json"  # {"name": ..., "parameters": ...} (Llama 3.1 to 3.3)
    MISTRAL = "mistral"  # [TOOL_CALLS][{"name": ..., "arguments": ...}]


class GuideKind(enum.StrEnum):
    JSON_SCHEMA = "json_schema"  # spec: the schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; no spec
    REGEX = "regex"
    CHOICE = "choice"  # spec: a JSON list of strings, one of which is the output
    GRAMMAR = "grammar"  # spec: a Lark grammar (or llama.cpp's GBNF)


class Guide(msgspec.Struct, frozen=True):
    """What a constrained output must match (structured outputs, forced tool calls)."""

    kind: GuideKind
    spec: str = ""
    source: str = ""  # the request field it came from, named in errors (response_format, ...)


Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
Bias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]


class SamplingParams(msgspec.Struct, frozen=True):
    # None: the rest of the context, which the daemon resolves per prompt (what the proxy sends
    # when a client leaves it out); 16 is only the default of records made in code, as in
    # vLLM's SamplingParams.
    max_tokens: PosInt | None = 16
    # max_tokens as a ceiling (Anthropic's reading): past the room the prompt leaves in the
    # context, that room, not a refusal.
    max_tokens_ceiling: bool = False
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
    guide: Guide | None = None  # the output is constrained to match it
    # As vLLM defines them (daemon/engine/logits_processors.py): presence and frequency over the
    # output's tokens, repetition over the prompt's and the output's, min_p relative to the
    # most likely token, logit_bias added to the logits of token ids, bad_words' token
    # sequences never completed in the output.
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    logit_bias: dict[int, Bias] = {}
    bad_words: list[str] = []
    # Completions: each choice starts with its prompt (Delta.prompt), with logprobs its prompt
    # tokens' log-probabilities too.
    echo: bool = False
    # Speculative decoding: at most this many drafts a step (0: none); None or more than the
    # server's --speculative-config: the server's.
    num_speculative_tokens: NonNegInt | None = None


class ResponseFields(msgspec.Struct, frozen=True):
    """Responses-API state carried by a Submit of kind RESPONSE; the daemon owns the store."""

    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    instructions: str | None = None
    # The request's input as chat messages (the proxy parses it; instructions not included).
    input: list[Message] = []
    # The input items as the proxy validated them, as JSON text of a list of objects: stored
    # as they are and listed a page at a time; the daemon reads no more of an item than its
    # `id` (daemon/responses/items.py). (Text, not msgspec.Raw: a Raw decoded in place would
    # pin the reader's buffer, which drops each frame once decoded.)
    input_items: str = "[]"
    # Echoed into the stored response object.
    created_at: int = 0
    model: str = ""
    # The request offered tools: its output is text in this format, to be parsed for calls.
    tool_call_format: ToolCallFormat | None = None
    # A turn of this conversation: its items are the history, and on completion the input items
    # and the output join it. `input_spans[i]`: how many of `input` input item i renders as.
    conversation: str | None = None
    input_spans: list[int] = []
    # The request fields the Response object echoes (text, tools, tool_choice, metadata, ...),
    # as JSON text of an object: stored as they are, read by the proxy only.
    echo: str = "{}"
    # Whose response it is: the API key's tag ("" without keys). Retention is fair between
    # tenants, and a tenant's item references reach only its own items.
    tenant: str = ""


# --- proxy -> daemon: requests pipe -------------------------------------------------------------


class Submit(msgspec.Struct, tag=Kind.SUBMIT.value, tag_field="k"):
    """One HTTP request = one engine session.

    Sequences are ``len(prompts) * n`` (completions) or ``n`` (chat, responses); sequence
    index ``i`` is prompt ``i // n``, sample ``i % n`` as OpenAI numbers choices.
    ``rid`` is the engine's key, always made by the proxy (for RESPONSE, the response id); the
    daemon admits a Submit only if ``epoch`` is the connection's current one. The proxy's
    connection stamps ``epoch`` as it queues the record (0, never assigned, until then), as it
    does on the control records.
    """

    rid: str
    kind: RequestKind
    sampling: SamplingParams
    epoch: int = 0
    n: PosInt = 1
    prompts: list[str] = []
    # Prompts given as token ids (completions instead of `prompts`; DETOKENIZE: the ids).
    prompt_ids: list[list[int]] = []
    messages: list[Message] = []
    response: ResponseFields | None = None
    t_submit: float = 0.0  # proxy monotonic time when the HTTP request arrived
    tools: list[ToolFunction] = []  # offered to the model through the chat template
    client_id: str | None = None  # the client's X-Request-Id: logged, never a key
    # TOKENIZE: the special tokens the tokenizer adds (None: for a prompt yes, after a chat
    # template, which writes its own, no) and whether messages end with the assistant's turn.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True

    @property
    def num_sequences(self) -> int:
        if self.kind is RequestKind.COMPLETION:
            return (len(self.prompts) or len(self.prompt_ids)) * self.n
        return self.n


# --- proxy -> daemon: control pipe --------------------------------------------------------------


class Hello(msgspec.Struct, tag=Kind.HELLO.value, tag_field="k"):
    """A proxy connects. The daemon answers with a Welcome that assigns the connection's epoch:
    at least ``epoch`` (the proxy's last one + 1) and above every epoch it assigned before.
    Hellos repeated by one connection carry the same ``nonce`` and get the same epoch."""

    version: int
    pid: int
    epoch: int
    nonce: int = 0


class Heartbeat(msgspec.Struct, tag=Kind.HEARTBEAT.value, tag_field="k"):
    epoch: int
    t: float


class Goodbye(msgspec.Struct, tag=Kind.GOODBYE.value, tag_field="k"):
    """The last record of a side that stops cleanly (the proxy on control, the daemon on
    tokens): the EOF that follows is a close, not a loss."""

    epoch: int


class Abort(msgspec.Struct, tag=Kind.ABORT.value, tag_field="k"):
    rid: str
    cause: AbortCause
    epoch: int = 0
    # Proxy monotonic time at which it saw the disconnect (CLOCK_MONOTONIC is system-wide).
    t_disconnect: float | None = None


class Pause(msgspec.Struct, tag=Kind.PAUSE.value, tag_field="k"):
    """The proxy holds too much of this session that its client has not read: stop scheduling
    it (its KV blocks stay) until a Resume."""

    rid: str
    epoch: int = 0


class Resume(msgspec.Struct, tag=Kind.RESUME.value, tag_field="k"):
    rid: str
    epoch: int = 0


# --- daemon -> proxy: tokens pipe ---------------------------------------------------------------


class GenerationDefaults(msgspec.Struct, frozen=True, omit_defaults=True):
    """The model's own sampling defaults (generation_config.json, GGUF's general.sampling.*), as
    vLLM's --generation-config auto takes them: what a request that omits the field gets. None:
    the model says nothing, and the API's default holds."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None  # 0 and -1: no top-k
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] | None = None


class Welcome(msgspec.Struct, tag=Kind.WELCOME.value, tag_field="k"):
    version: int
    pid: int
    model: str
    max_model_len: int
    epoch: int  # the epoch this daemon assigned to the connection
    nonce: int = 0  # the Hello's, so the proxy knows the Welcome is for this connection
    tensor_parallel_size: int = 1  # ranks the model runs on
    tool_call_format: ToolCallFormat = ToolCallFormat.HERMES  # how the model writes tool calls
    # The chat template takes one tool call a turn (it raises for more, as Llama 3.1's does):
    # the proxy asks for one whatever parallel_tool_calls says.
    single_tool_call: bool = False
    generation_defaults: GenerationDefaults = msgspec.field(default_factory=GenerationDefaults)


class Admitted(msgspec.Struct, tag=Kind.ADMITTED.value, tag_field="k"):
    """A Submit was read and queued: the proxy's request deadline covers only the time until
    this (or a Delta, Finish or Error), never the time a request waits for its turn."""

    rid: str


class Alive(msgspec.Struct, tag=Kind.ALIVE.value, tag_field="k"):
    """Sent while a long forward pass keeps the tick loop from sending Stats."""

    t: float


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    """A sampled token's log-probability under the model, and the most likely tokens there.

    ``token`` is the token's own bytes as they extend the text (a token can hold part of a UTF-8
    character; the proxy renders the text); ``top`` holds (bytes, logprob) pairs, most likely
    first."""

    token: bytes
    logprob: float
    top: list[tuple[bytes, float]] = []


class Delta(msgspec.Struct, tag=Kind.DELTA.value, tag_field="k", omit_defaults=True):
    """Text and the token ids it came from; with ``prompt``, the echo of the choice's prompt,
    before its first generated token: its text and ids in the first such Delta, and with
    logprobs one entry per prompt token, spread over Deltas of at most ECHO_TOKENS entries (the
    first prompt token has no log-probability: its entry's value is 0.0, shown as null)."""

    rid: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked
    prompt: bool = False
    prompt_tokens: int = 0  # on a sequence's first generated Delta: its prompt's length


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
    stop: str | None = None  # the stop string that ended it, when one did


class Error(msgspec.Struct, tag=Kind.ERROR.value, tag_field="k"):
    """A rejected Submit (the whole session) or, with rid None, a daemon-wide problem. `reason`
    travels as "code" (its former name), so that daemons and proxies of different releases
    still read each other's refusal of a Hello (Reason.VERSION_MISMATCH)."""

    rid: str | None
    message: str
    reason: Reason = msgspec.field(default=Reason.INVALID, name="code")
    param: str | None = None
