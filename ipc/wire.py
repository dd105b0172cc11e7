"""Which records each direction carries: the tagged unions the pipes' decoders decode.

- ``requests`` (proxy -> daemon): Submit, ResponseOp of a conversation or a request's item
  references (they can be big)
- ``control``  (proxy -> daemon): Hello, Heartbeat, Goodbye, Abort, Pause, Resume, ResponseOp
- ``tokens``   (daemon -> proxy): Welcome, Admitted, Delta, Finish, Error, Stats, Alive,
  ResponseReply, Goodbye

Every new connection starts with a bare newline on each pipe, so a frame half-written by the
previous connection ends there (one bad record) instead of swallowing the first new one.
"""

from __future__ import annotations

from ipc.records import (
    Abort,
    Admitted,
    Alive,
    Delta,
    Error,
    Finish,
    Goodbye,
    Heartbeat,
    Hello,
    Pause,
    Resume,
    Submit,
    Welcome,
)
from ipc.response_records import ResponseOp, ResponseReply
from ipc.stats import Stats

ToDaemon = Submit | Hello | Heartbeat | Goodbye | Abort | Pause | Resume | ResponseOp
ToProxy = Welcome | Admitted | Delta | Finish | Error | Stats | Alive | ResponseReply | Goodbye
Record = ToDaemon | ToProxy
