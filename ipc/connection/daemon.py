"""The daemon's side of the proxy connection, on top of its pipes (ipc/daemon_side.py).

It answers each Hello: a proxy of another protocol version is refused with an Error whose code
is VERSION_MISMATCH; a new connection gets an epoch above every earlier one (`EpochCounter`)
and a Welcome saying what model is served; a Hello repeated by the same connection (same
nonce) gets the same epoch again. Only Submits of the current epoch are work; the others (still
in the pipe from an earlier connection, or read after the proxy was lost or said Goodbye) come
back as `Stale`, for the tick loop to end at once.

What the tick loop reads from here, in pipe order: the work records (Abort, Pause, Resume,
ResponseOp, current Submits) and what happened to the connection: `Connected` (a new epoch:
older epochs' sessions have no client any more), the current proxy's `Goodbye`, `Lost` (with
its reason), and the records this side answers with (Welcome, the refusal's Error), which go
out in order with the loop's own.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from ipc.connection.epochs import EpochCounter
from ipc.daemon_side import DaemonPipes
from ipc.loss import Loss
from ipc.records import (
    PROTOCOL_VERSION,
    VERSION_MISMATCH,
    Abort,
    Error,
    GenerationDefaults,
    Goodbye,
    Hello,
    Pause,
    Resume,
    Submit,
    ToolCallFormat,
    Welcome,
    version_mismatch,
)
from ipc.response_records import ResponseOp

log = logging.getLogger("tether.ipc")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What every Welcome says about the model served."""

    name: str
    max_model_len: int
    tensor_parallel_size: int = 1
    tool_call_format: ToolCallFormat = ToolCallFormat.HERMES
    single_tool_call: bool = False  # the chat template takes one call a turn
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)


@dataclass(frozen=True, slots=True)
class Connected:
    """A new proxy connection, under `epoch`."""

    epoch: int


@dataclass(frozen=True, slots=True)
class Lost:
    """The proxy is gone (see `Loss.reason`); no epoch is current until the next Hello."""

    loss: Loss


@dataclass(frozen=True, slots=True)
class Stale:
    """A Submit not of the current epoch: its client is gone, it must not run."""

    submit: Submit


ControlItem = Abort | Pause | Resume | ResponseOp | Connected | Goodbye | Lost | Welcome | Error


class DaemonConnection:
    def __init__(self, pipes: DaemonPipes, model: ModelInfo,
                 epochs: EpochCounter | None = None) -> None:
        self.pipes = pipes
        self.model = model
        self.epochs = epochs or EpochCounter()
        self.epoch: int | None = None  # the current connection's; None: none is open
        self._nonce: int | None = None  # its Hello's
        self._refused_nonce: int | None = None

    def read_control(self) -> list[ControlItem]:
        """The control records read now, turned into work and events; then a loss the pipes
        noticed since the last call (in this read or after it)."""
        out: list[ControlItem] = []
        for rec in self.pipes.read_control():
            if isinstance(rec, Hello):
                out += self._hello(rec)
            elif isinstance(rec, Goodbye):
                out += self._goodbye(rec)
            elif isinstance(rec, Abort | Pause | Resume | ResponseOp):
                out.append(rec)
            # A Heartbeat has done its work: the pipes track the silence.
        out += self._take_lost()
        return out

    def read_requests(self) -> list[Submit | Stale | ResponseOp]:
        """Submits (a stale one as Stale) and the current connection's conversation ops (an
        earlier one's proxy has failed them already)."""
        epoch = self.epoch
        out: list[Submit | Stale | ResponseOp] = []
        for rec in self.pipes.read_requests():
            if isinstance(rec, Submit):
                out.append(rec if rec.epoch == epoch else Stale(rec))
            elif isinstance(rec, ResponseOp) and rec.epoch == epoch:
                out.append(rec)
        return out

    def _take_lost(self) -> list[Lost]:
        loss = self.pipes.take_lost()  # EOF, EPIPE, a stalled reader or heartbeat silence
        if loss is None:
            return []
        self.epoch = None  # what the proxy left in the pipes is for nobody
        return [Lost(loss)]

    def _hello(self, rec: Hello) -> list[ControlItem]:
        if rec.version != PROTOCOL_VERSION:
            message = version_mismatch(PROTOCOL_VERSION, rec.version)
            if rec.nonce != self._refused_nonce:  # the proxy retries every few seconds
                log.error("proxy pid %d refused: %s", rec.pid, message)
                self._refused_nonce = rec.nonce
            return [Error(None, message, status=500, code=VERSION_MISMATCH)]
        out: list[ControlItem] = []
        epoch = self.epoch
        if epoch is None or rec.nonce != self._nonce:
            # A new connection (a repeated Hello of the current one keeps its epoch). A loss
            # noticed since the last read belongs to the old one: settle it first.
            out += self._take_lost()
            epoch = self.epochs.next(at_least=rec.epoch)
            log.info("proxy pid %d connected: epoch %d", rec.pid, epoch)
            self.epoch, self._nonce = epoch, rec.nonce
            out.append(Connected(epoch))
        model = self.model
        out.append(Welcome(PROTOCOL_VERSION, os.getpid(), model.name, model.max_model_len,
                           epoch, rec.nonce, model.tensor_parallel_size, model.tool_call_format,
                           model.single_tool_call, model.generation_defaults))
        return out

    def goodbye(self) -> Goodbye | None:
        """The daemon stops cleanly: its Goodbye to the current proxy (None if none is
        connected), to go out as its last record."""
        self.pipes.stop_keepalive()
        epoch, self.epoch = self.epoch, None
        return None if epoch is None else Goodbye(epoch)

    def _goodbye(self, rec: Goodbye) -> list[Goodbye]:
        if rec.epoch != self.epoch:
            log.info("ignoring a goodbye of epoch %d (current: %s)", rec.epoch, self.epoch)
            return []
        log.info("proxy (epoch %d) said goodbye", rec.epoch)
        self.epoch = None
        return [rec]
