"""Aborts with speculative decoding on (issue 38): drafts live in one step's batch only, so a
dropped connection mid-verify leaves the daemon at its baseline (no running sequence, no KV
block, nothing waiting) in the tick that applied the abort, as without speculation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.metrics import m
from tests.support.pair import (
    ABORT_MODEL,
    CHAT,
    LONG,
    Server,
    check_abort,
    drop,
    drop_mid_stream,
    new_rid,
    post_raw,
    start_server,
    wait_running,
)

pytestmark = pytest.mark.timeout(180)

K = 4
SPECULATIVE = json.dumps({"method": "ngram", "num_speculative_tokens": K,
                          "prompt_lookup_max": 3, "prompt_lookup_min": 1})
# A prompt that repeats itself, and a greedy random model's answer loops: drafts are accepted.
REPEATING = {"prompt": "one two three four " * 8, **LONG}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("e2e-spec"),
                     ["--max-num-seqs", "8", *ABORT_MODEL, "--speculative-config", SPECULATIVE])
    yield s
    s.stop()


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {**REPEATING, "stream": True}),
    ("/v1/completions", {**REPEATING, "stream": True, "temperature": 0.8, "seed": 3}),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
], ids=["greedy", "sampled", "chat"])
def test_streaming_disconnect_mid_speculation_evicts_session(server: Server, path: str,
                                                             body: dict[str, Any]) -> None:
    drop_mid_stream(server, path, body, "spec-drop", 20, tokens_per_pass=1 + K)


def test_non_streaming_disconnect_mid_speculation_evicts_session(server: Server) -> None:
    before = server.metrics()
    rid = new_rid("spec-plain-drop")
    sock = post_raw(server, "/v1/completions", REPEATING, rid)
    wait_running(server)
    check_abort(server, before, rid, drop(sock), sequences=1, tokens_per_pass=1 + K)


def test_a_pass_that_verified_drafts_counts_all_its_tokens(server: Server) -> None:
    """Some pass gave the request several tokens (speculation was on), and after the drop no
    more than one pass's 1 + K."""
    rid = drop_mid_stream(server, "/v1/completions", {**REPEATING, "stream": True},
                          "spec-drafted", 60, tokens_per_pass=1 + K)
    ticks = server.request_line(rid)["last_ticks"]
    assert any(n > 1 for _, n in ticks), ticks
    figures = server.metrics()
    drafts = m(figures, "tether_spec_decode_num_drafts_total")
    accepted = m(figures, "tether_spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= m(figures, "tether_spec_decode_num_draft_tokens_total") <= K * drafts
