"""A request the daemon refuses, for any reason a client could cause or should hear about.

Raised by admission (daemon/engine/) and by the response store's room (daemon/responses/);
the engine turns it into that request's `Error` record, naming the field and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipc.records import Error


class Rejected(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    def to_error(self, rid: str) -> Error:
        return Error(rid=rid, message=self.message, status=self.status, param=self.param,
                     code=self.code)


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
            f"{self.max_bytes} bytes of text; {what} holds {holds}; {advice}", param=param,
            code="context_length_exceeded")
