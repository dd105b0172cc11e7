"""The daemon's queue of ResponseOps: clients take turns, and a client past its share of the
places is refused at once (503, not applied) while another still gets in."""

from daemon.responses.op_queue import OpQueue
from ipc.response_records import ResponseGet, ResponseOp


def _op(client: str, i: int) -> ResponseOp:
    return ResponseOp(f"{client}-{i}", ResponseGet("resp_x"), client=client)


def test_clients_take_turns_each_in_its_own_order() -> None:
    queue = OpQueue()
    for i in range(3):
        assert queue.put(_op("a", i)) is None
    assert queue.put(_op("b", 0)) is None
    assert queue.put(_op("c", 0)) is None
    taken = []
    while (op := queue.take()) is not None:
        taken.append(op.op_id)
    assert taken == ["a-0", "b-0", "c-0", "a-1", "a-2"]
    assert len(queue) == 0


def test_a_client_past_its_places_is_refused_and_another_is_not() -> None:
    queue = OpQueue(max_waiting=5, max_per_client=3)
    assert [queue.put(_op("a", i)) for i in range(3)] == [None] * 3
    refused = queue.put(_op("a", 3))
    assert refused is not None and refused.status == 503 and refused.op_id == "a-3"
    assert refused.message is not None and "not applied" in refused.message
    assert queue.put(_op("b", 0)) is None and queue.put(_op("c", 0)) is None
    full = queue.put(_op("d", 0))
    assert full is not None and full.status == 503 and "5 store operations" in (full.message or "")
