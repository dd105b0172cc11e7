"""Codex CLI (the real binary, @openai/codex) runs `codex exec` with its default prompt and tools
against the real pair on a real port, over the Responses API as Codex speaks it: one streamed
POST /v1/responses a turn, with function tools, a namespace of functions, hosted web_search,
`include: ["reasoning.encrypted_content"]`, `reasoning: {"summary": ...}`, `store: false` and
`client_metadata`, its instructions as developer messages of ~8k tokens.

The checkpoint is a random Llama 3 (its tokenizer and chat template, tools rendered in it) whose
end-of-turn token is scaled so that its turns end within tens of tokens: Codex treats a turn cut
at the output budget as an error, and a random model of 128k ids all but never ends one. Its
answer is noise; the exchange must be valid: every request a 200, the stream well-formed to
`response.completed`, Codex's own "turn completed" and exit 0, and the pair idle after.

Whether a random model calls a tool is chance, so a second run forces one: a loopback shim
between Codex and the pair adds `tool_choice` naming `get_goal` (a tool Codex runs itself,
with no shell) to Codex's first request only; the grammar makes the call valid, Codex runs it
and sends its function_call and function_call_output back, and the model's next turn ends.

Codex is found through TETHER_CODEX (`make test` installs it under .codex/); without it the
test is skipped and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.pair import Server, assert_baseline, start_server
from tests.support.real_tokenizers import save_random_checkpoint
from tests.support.shim import shim

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
CODEX = Path(os.environ.get("TETHER_CODEX", ROOT / ".codex" / "node_modules" / ".bin" / "codex"))
# Llama 3.1's template, which renders tools and an assistant turn of calls alone.
FAMILY = "llama3"
NAME = "codex-ckpt"  # the checkpoint's directory: the model name the pair serves
# Codex's prompt renders as ~8k Llama 3 tokens (its instructions, skills, tools, environment).
MAX_LEN = 10240
END_SCALE = 5.0

CONFIG = """model = "{name}"
model_provider = "tether"

[model_providers.tether]
name = "tether"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "TETHER_TEST_KEY"
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if not os.access(CODEX, os.X_OK):
        pytest.skip(f"Codex CLI is not installed at {CODEX} (`make test` installs it with npm; "
                    "TETHER_CODEX names another binary)")
    checkpoint = save_random_checkpoint(FAMILY, tmp_path_factory.mktemp("ckpt") / NAME,
                                        max_len=MAX_LEN, end_scale=END_SCALE)
    server = start_server(tmp_path_factory.mktemp("pair"),
                          ["--model", str(checkpoint), "--max-num-seqs", "2"])
    yield server
    server.stop()


def _codex(url: str, tmp: Path, prompt: str) -> subprocess.CompletedProcess[str]:
    home, work = tmp / "codex-home", tmp / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(CONFIG.format(name=NAME, url=url))
    # Only loopback: the provider is the pair; nothing else of the environment reaches Codex.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp),
           "CODEX_HOME": str(home), "TETHER_TEST_KEY": "unused", "NO_COLOR": "1"}
    return subprocess.run([str(CODEX), "exec", "--json", "--skip-git-repo-check", prompt],
                          cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=240)


def _completed(ran: subprocess.CompletedProcess[str], pair: Server) -> list[dict[str, Any]]:
    """Codex's events of a run that ended in its normal way, every request of it served."""
    assert ran.returncode == 0, (ran.stdout[-4000:], ran.stderr[-4000:], pair.logs())
    events = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("{")]
    kinds = [e["type"] for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds and "error" not in kinds, kinds
    served = [(line["msg"], line.get("error")) for line in pair.log_lines("proxy")
              if line["logger"] == "tether.access"
              and line.get("route") not in ("/health", "/metrics")]  # the test's own
    assert served and all(msg == "POST /v1/responses 200" for msg, _ in served), served
    assert_baseline(pair.metrics())
    return events


def test_codex_exec_runs_a_turn_to_its_end(pair: Server, tmp_path: Path) -> None:
    events = _completed(_codex(pair.url, tmp_path, "List the files here, then say hi."), pair)
    usage = next(e for e in events if e["type"] == "turn.completed")["usage"]
    assert 5_000 < usage["input_tokens"] < MAX_LEN - 1_024, usage  # Codex's whole prompt


def test_a_tool_codex_runs_goes_there_and_back(pair: Server, tmp_path: Path) -> None:
    def forcing(index: int, body: dict[str, Any]) -> None:
        if index == 0:
            body["tool_choice"] = {"type": "function", "name": "get_goal"}

    with shim(pair.url, ("authorization",), forcing) as (url, seen):
        ran = _codex(url, tmp_path, "What is my goal?")
    bodies = [request["body"] for request in seen]
    _completed(ran, pair)
    [call] = [item for item in bodies[1]["input"] if item["type"] == "function_call"]
    assert call["name"] == "get_goal" and json.loads(call["arguments"]) == {}
    [output] = [item for item in bodies[1]["input"] if item["type"] == "function_call_output"]
    assert output["call_id"] == call["call_id"] and output["output"]

