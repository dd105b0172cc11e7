"""Why the daemon refuses a request or a store operation: a typed reason, never an HTTP status.

The daemon's message names the field and the limit, and its `param` the field; the proxy turns
each reason into the status and the OpenAI error code a client gets (proxy/http/errors.py), so a new
API surface maps reasons, and the engine knows nothing of HTTP.
"""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    # The request asks for what cannot be: a field out of its bounds, an empty prompt, a
    # combination the server refuses (its param names the field).
    INVALID = "invalid"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt and output pass the context
    TOO_MANY_SEQUENCES = "too_many_sequences"  # prompts x n over the server's limit
    MAX_TOKENS_TOO_SMALL = "max_tokens_too_small"  # shorter than a guide's shortest output
    INVALID_GRAMMAR = "invalid_grammar"  # a guide that does not compile
    GRAMMAR_TOO_COMPLEX = "grammar_too_complex"  # a guide past the parser's limits
    GRAMMAR_TIMEOUT = "grammar_timeout"  # a guide whose compile took too long
    CONVERSATION_FULL = "conversation_full"  # past a conversation's bound on items
    TOO_LARGE = "too_large"  # an answer too large to send, or items too large to serve
    NOT_FOUND = "not_found"  # no such stored response, conversation or item
    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"
    DUPLICATE_ID = "duplicate_id"  # a request id that is already running
    CONVERSATION_LOCKED = "conversation_locked"  # another turn of the conversation is running
    NO_STORE = "no_store"  # the Responses API, on a daemon without a response store
    STORE_ERROR = "store_error"  # the response store failed
    STORE_TIMEOUT = "store_timeout"  # the response store did not answer in time: retry
    INTERNAL = "internal"  # the daemon failed at something it should not
    VERSION_MISMATCH = "version_mismatch"  # a proxy of another protocol version (its Hello)
    SHUTTING_DOWN = "shutting_down"  # the daemon is stopping: retry on another
    NOT_APPLIED = "not_applied"  # an operation the daemon did not apply (it waited too long,
    # or too many wait): retry
