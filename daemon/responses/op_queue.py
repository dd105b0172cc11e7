"""The ResponseOps waiting for the store, fair between clients.

Each client (``ResponseOp.client``: its API key's tag, or its address on a server without keys)
has a queue of its own, and the clients take turns: whatever one client has waiting, another's
op waits for at most one op of each client ahead of it. One client holds at most
``max_per_client`` waiting ops and all together at most ``max_waiting``; past either a new op is
refused at once (503, not applied), so a flood costs its own client its ops, not the others.

The store thread takes them (daemon/responses/store_thread.py: one at a time, after the engine's
own work, and only while the replies it has not handed over are under their bound), and answers
an op whose ``deadline`` has passed without applying it: its proxy has stopped waiting for it.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from ipc.response_records import ResponseOp, ResponseReply

MAX_WAITING_OPS = 1024
MAX_OPS_PER_CLIENT = 256


class OpQueue:
    def __init__(self, max_waiting: int = MAX_WAITING_OPS,
                 max_per_client: int = MAX_OPS_PER_CLIENT) -> None:
        self.max_waiting = max_waiting
        self.max_per_client = max_per_client
        self._queues: OrderedDict[str, deque[ResponseOp]] = OrderedDict()  # in turn order
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def put(self, op: ResponseOp) -> ResponseReply | None:
        """Queues the op; or, past a bound, the 503 that answers it now (nothing applied)."""
        queue = self._queues.get(op.client)
        if queue is not None and len(queue) >= self.max_per_client:
            return self._refusal(op, f"this client has {self.max_per_client} store operations "
                                 "waiting")
        if self._count >= self.max_waiting:
            return self._refusal(op, f"{self.max_waiting} store operations are waiting")
        if queue is None:
            queue = self._queues[op.client] = deque()
        queue.append(op)
        self._count += 1
        return None

    def peek(self) -> ResponseOp | None:
        """The op `take` would give, left in place."""
        return next(iter(self._queues.values()))[0] if self._queues else None

    def take(self) -> ResponseOp | None:
        """The next op: the oldest of the client whose turn it is."""
        if not self._queues:
            return None
        client, queue = next(iter(self._queues.items()))
        op = queue.popleft()
        self._count -= 1
        if queue:
            self._queues.move_to_end(client)
        else:
            del self._queues[client]
        return op

    def clear(self) -> None:
        self._queues.clear()
        self._count = 0

    @staticmethod
    def _refusal(op: ResponseOp, why: str) -> ResponseReply:
        return ResponseReply(op.op_id, 503, message=f"{why}; this one was not applied: retry")
