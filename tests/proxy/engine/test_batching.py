"""Merging the Deltas a stream's reader found waiting (--stream-merge-tokens)."""

from __future__ import annotations

from ipc.records import Delta, Finish, FinishReason, TokenLogprob, Usage
from proxy.engine.batching import Batch, merge_deltas


def delta(index: int, k: int, logprobs: bool = False) -> Delta:
    lps = [TokenLogprob(f"t{k}".encode(), -float(k), [(b"alt", -9.0)])] if logprobs else None
    return Delta("r", index, f"t{k}", [k], lps)


def finish(index: int) -> Finish:
    return Finish("r", index, FinishReason.STOP, Usage(1, 1))


def test_each_sequence_merges_in_order_up_to_the_limit() -> None:
    batch: Batch = [delta(0, 0), delta(1, 0), delta(0, 1), delta(1, 1), delta(0, 2),
                    delta(0, 3)]
    merged = merge_deltas(batch, 3)
    assert all(isinstance(d, Delta) for d in merged)
    assert [(d.index, getattr(d, "text", None), getattr(d, "token_ids", None))
            for d in merged] == [(0, "t0t1t2", [0, 1, 2]), (1, "t0t1", [0, 1]), (0, "t3", [3])]


def test_log_probabilities_follow_their_tokens() -> None:
    batch: Batch = [delta(0, k, logprobs=True) for k in range(3)]
    merged = merge_deltas(batch, 8)
    assert len(merged) == 1
    only = merged[0]
    assert isinstance(only, Delta) and only.logprobs is not None
    assert [lp.token for lp in only.logprobs] == [b"t0", b"t1", b"t2"]
    assert [lp.top for lp in only.logprobs] == [[(b"alt", -9.0)]] * 3


def test_nothing_moves_across_a_finish() -> None:
    batch: Batch = [delta(0, 0), finish(0), delta(1, 0), delta(1, 1)]
    merged = merge_deltas(batch, 8)
    assert [type(r).__name__ for r in merged] == ["Delta", "Finish", "Delta"]
    assert merged[2] == Delta("r", 1, "t0t1", [0, 1])


def test_a_delta_over_the_limit_stays_whole_and_a_lone_record_is_untouched() -> None:
    big = Delta("r", 0, "abc", [1, 2, 3])
    batch: Batch = [big, delta(0, 4)]
    assert merge_deltas(batch, 2) == [big, delta(0, 4)]
    single: Batch = [delta(0, 0)]
    assert merge_deltas(single, 4) is single
