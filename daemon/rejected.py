"""A request the daemon refuses, for any reason a client could cause or should hear about.

Raised by admission (daemon/engine/) and by the response store's room (daemon/responses/);
the engine turns it into that request's `Error` record, naming the field and the limit.
"""

from __future__ import annotations

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
