from daemon.engine.session import _TICK_MEMORY, TickHistory


def test_tokens_after_counts_only_ticks_that_started_later() -> None:
    history = TickHistory()
    for i in range(10):
        history.append(float(i), 2)
    assert history.after(6.5) == (3, 6)  # ticks 7, 8, 9
    assert history.after(9.0) == (0, 0)  # a tick starting exactly then was already in flight
    assert history.after(-1.0) == (10, 20)


def test_history_stays_bounded_and_keeps_the_newest_ticks() -> None:
    history = TickHistory()
    total = 3 * _TICK_MEMORY
    for i in range(total):
        history.append(float(i), 1)
    assert len(history.starts) <= _TICK_MEMORY
    assert history.starts[-1] == total - 1
    assert history.after(total - 11.0) == (10, 10)


def test_tail_is_the_newest_ticks_oldest_first() -> None:
    history = TickHistory()
    assert history.tail(4) == []
    for i in range(6):
        history.append(float(i), i % 2)
    assert history.tail(4) == [(2.0, 0), (3.0, 1), (4.0, 0), (5.0, 1)]
    assert history.tail(10) == [(float(i), i % 2) for i in range(6)]
