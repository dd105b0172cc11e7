"""A request the daemon refuses, for any reason a client could cause or should hear about.

Raised by admission (daemon/engine/) and by the response store's room (daemon/responses/);
the engine turns it into that request's `Error` record: a typed reason (ipc/reasons.py, which
the proxy turns into an HTTP status), and words naming the field and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipc.reasons import Reason
from ipc.records import Error


class Rejected(Exception):
    def __init__(self, message: str, reason: Reason = Reason.INVALID,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.param = param

    def to_error(self, rid: str) -> Error:
        return Error(rid, self.message, self.reason, self.param)


@dataclass(frozen=True, slots=True)
class ContextBytes:
    """The most bytes of text a prompt that fits the context can hold: ``tokens`` tokens, none
    of which spells more than ``token_bytes`` bytes (the vocabulary's longest). A text longer
    than that cannot fit, whatever it tokenizes as: a test that needs no tokenizing. (It holds
    for a tokenizer that keeps every byte of its text, as byte-level and byte-fallback ones do;
    one whose normalizer dropped text would be refused here a text that would have fit.)"""

    tokens: int
    token_bytes: int

    @property
    def max_bytes(self) -> int:
        return self.tokens * self.token_bytes

    def refusal(self, what: str, holds: int, param: str, advice: str) -> Rejected:
        """``what`` holds ``holds`` bytes, more than the context can: context_length_exceeded."""
        return Rejected(
            f"this model's maximum context length is {self.tokens} tokens, and no token of its "
            f"vocabulary spells more than {self.token_bytes} bytes, so a prompt holds at most "
            f"{self.max_bytes} bytes of text; {what} holds {holds}; {advice}",
            Reason.CONTEXT_LENGTH_EXCEEDED, param)
