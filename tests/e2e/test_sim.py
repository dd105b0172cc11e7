"""`--model sim:<ms>` on the real pair: real token counts, token ids, aborts and gauges."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.metrics import m
from tests.support.pair import Server, check_abort_figures, drop, post_raw, start_server
from tests.support.raw_http import read_events, sse_json

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("e2e-sim"), ["--model", "sim:2"])
    yield s
    s.stop()


def test_streams_carry_every_token_id_that_usage_counts(sim: Server) -> None:
    body = {"model": "sim:2", "prompt": ["a", "b"], "n": 2, "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    ids: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    usage: dict[str, int] = {}
    with sim.client() as c, c.stream("POST", "/v1/completions", json=body) as s:
        for event in map(sse_json, s.iter_lines()):
            if event and event.get("usage"):
                usage = event["usage"]
            for choice in (event or {}).get("choices", []):
                ids.setdefault(choice["index"], []).extend(choice.get("token_ids", ()))
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert sorted(ids) == [0, 1, 2, 3] and all(len(v) == 50 for v in ids.values())
    assert usage["completion_tokens"] == 200 and usage["prompt_tokens"] == 4
    assert all(len(t.split()) == 50 for t in texts.values())  # one word a token


def test_a_dropped_stream_is_evicted_like_any_other(sim: Server) -> None:
    before = sim.metrics()
    sock = post_raw(sim, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "go"}], "max_tokens": 20000, "stream": True})
    read_events(sock, 5)
    drop(sock)
    after = check_abort_figures(sim, before)
    assert m(after, "tether_engine_ticks_total") > m(before, "tether_engine_ticks_total")


def test_a_bad_sim_spec_stops_the_daemon_naming_it(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tether.cli", "daemon", "--model", "sim:fast",
         "--runtime-dir", str(tmp_path / "run"), "--state-dir", str(tmp_path / "state"),
         "--log-format", "text"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "sim:<milliseconds per tick>" in proc.stderr


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 20000}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 32600}]}),
    ("/v1/completions", {"prompt": "x" * 32600}),
    ("/v1/responses", {"input": "x" * 20000}),
])
def test_a_long_prompt_without_max_tokens_is_never_refused(sim: Server, path: str,
                                                           body: dict[str, object]) -> None:
    """A 20k-token prompt, and one that leaves fewer tokens than any fixed default would (the
    context is 32768): both answered, streaming until the client has what it wants."""
    with sim.client() as c, c.stream("POST", path, json={**body, "stream": True}) as s:
        assert s.status_code == 200, s.read()[:300]
        events = []
        for event in map(sse_json, s.iter_lines()):
            if event is not None:
                events.append(event)
            if len(events) >= 5:
                break
    assert not any("error" in e for e in events), events
    assert any(e.get("choices") or e.get("type") == "response.output_text.delta" for e in events)
