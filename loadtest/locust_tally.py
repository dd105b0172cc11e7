"""What the load test's clients saw, and the checks that pass or fail the run at its end."""

from __future__ import annotations

import collections
from typing import Any

from loadtest.metrics import Metrics


class Tally:
    """What the clients saw, summed over every user of this process."""

    def __init__(self) -> None:
        self.dropped_requests: collections.Counter[str] = collections.Counter()
        self.dropped_sequences = 0
        self.completed: collections.Counter[str] = collections.Counter()
        self.status_5xx = 0
        self.usage_mismatch = 0
        self.baseline: Metrics | None = None
        self.settle: dict[str, Any] = {}

    def drop(self, kind: str, sequences: int) -> None:
        self.dropped_requests[kind] += 1
        self.dropped_sequences += sequences


# One tally per locust process: run the load test alone, not distributed.
TALLY = Tally()


def checks(tally: Tally, final: Metrics) -> tuple[dict[str, Any], list[str]]:
    """The run's figures, and what fails it (an empty list: it passes)."""
    assert tally.baseline is not None
    base = tally.baseline

    def delta(name: str) -> float:
        return final.total(name) - base.total(name)

    after_disconnect = delta("tether_tokens_after_disconnect_total")
    dropped = tally.dropped_sequences
    report: dict[str, Any] = {
        "dropped_requests": dict(tally.dropped_requests),
        "dropped_sequences": dropped,
        "completed_requests": dict(tally.completed),
        "responses_5xx": tally.status_5xx,
        "tokens_after_disconnect": after_disconnect,
        "tokens_after_disconnect_per_drop": after_disconnect / dropped if dropped else None,
        "generation_tokens": delta("tether_generation_tokens_total"),
        "prompt_tokens": delta("tether_prompt_tokens_total"),
        "aborts_by_cause": {k: v - base.by_label("tether_aborts_total", "cause").get(k, 0.0)
                            for k, v in final.by_label("tether_aborts_total", "cause").items()},
        "stream_usage_mismatches": tally.usage_mismatch,
        "settle": tally.settle,
    }
    problems: list[str] = []
    if not tally.settle.get("settled", False):
        problems.append(f"gauges not back to baseline {tally.settle.get('baseline')} within "
                        f"{tally.settle.get('waited_s', 0):.2f} s: {tally.settle.get('after')}")
    if tally.status_5xx:
        problems.append(f"{tally.status_5xx} responses with a 5xx status")
    if after_disconnect > dropped:
        problems.append(f"{after_disconnect:.0f} tokens generated after disconnect for "
                        f"{dropped} dropped sequences (limit 1 each)")
    bad_ipc = delta("tether_ipc_bad_records_total")
    if bad_ipc:
        problems.append(f"{bad_ipc:.0f} bad IPC records")
    return report, problems
