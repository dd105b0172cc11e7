"""Claude Code (the real binary, @anthropic-ai/claude-code) runs `claude -p` with its default
prompt and tools against the real pair on a real port, over the Messages API as Claude Code
speaks it, its key in `x-api-key` (the pair has --api-key). What it sends (docs/endpoints.md
says it, and the first test checks it still is so): one streamed POST /v1/messages?beta=true a
turn, with `anthropic-version` and an `anthropic-beta` list, `system` as text blocks with
`cache_control`, a `system`-role message after the user's, tools (one with `defer_loading`),
`thinking: {"type": "adaptive"}`, `context_management`, `output_config.effort`,
`metadata.user_id` and `max_tokens: 32000`, about 12k Llama 3 tokens in all.

The checkpoint is a random Llama 3 (its tokenizer and chat template, tools rendered in it) whose
end-of-turn token is scaled so that its turns end within tens of tokens, as the Codex test's
(tests/e2e/test_codex.py). Its answer is noise; the exchange must be valid: every request a 200,
the stream well-formed to message_stop, Claude Code's result not an error and exit 0, and the
pair idle after.

Whether a random model calls a tool is chance, so a second run forces one: a loopback shim
between Claude Code and the pair adds `tool_choice` naming `ListAgents` (a tool Claude Code runs
itself, reading nothing, whose arguments are all optional and bounded) to the first request only;
the grammar makes the call valid, Claude Code runs it and sends its tool_use and tool_result
back, and the model's next turn ends.

Claude Code is found through TETHER_CLAUDE (`make test` installs it under .claude-code/); without
it the test is skipped and says so.
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

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[2]
CLAUDE = Path(os.environ.get("TETHER_CLAUDE",
                             ROOT / ".claude-code" / "node_modules" / ".bin" / "claude"))
FAMILY = "llama3"  # Llama 3.1's template: tools, a turn of calls alone, system turns anywhere
NAME = "claude-ckpt"  # the checkpoint's directory: the model name the pair serves
KEY = "sk-claude-test"
# Claude Code's prompt renders as ~12k Llama 3 tokens (its system prompt, tools, environment).
MAX_LEN = 20480
END_SCALE = 5.0
FORCED = "ListAgents"
# The headers the shim passes on.
PASSED = ("x-api-key", "authorization", "anthropic-version", "anthropic-beta", "content-type",
          "user-agent")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if not os.access(CLAUDE, os.X_OK):
        pytest.skip(f"Claude Code is not installed at {CLAUDE} (`make test` installs it with "
                    "npm; TETHER_CLAUDE names another binary)")
    checkpoint = save_random_checkpoint(FAMILY, tmp_path_factory.mktemp("ckpt") / NAME,
                                        max_len=MAX_LEN, end_scale=END_SCALE)
    server = start_server(tmp_path_factory.mktemp("pair"),
                          ["--model", str(checkpoint), "--max-num-seqs", "2"], api_key=KEY)
    yield server
    server.stop()


def _claude(pair: Server, tmp: Path, prompt: str,
            force: str | None = None) -> tuple[subprocess.CompletedProcess[str], list[Any]]:
    def forcing(index: int, body: dict[str, Any]) -> None:
        if index == 0:
            body["tool_choice"] = {"type": "tool", "name": force}

    work = tmp / "work"
    work.mkdir()
    with shim(pair.url, PASSED, forcing if force is not None else None) as (url, seen):
        # Only loopback: the base URL is the shim; nothing else of the environment reaches it.
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp),
               "NO_COLOR": "1", "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": KEY,
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
               "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
               # Every model it might pick is the one served.
               "ANTHROPIC_MODEL": NAME, "ANTHROPIC_SMALL_FAST_MODEL": NAME,
               "ANTHROPIC_DEFAULT_HAIKU_MODEL": NAME, "ANTHROPIC_DEFAULT_SONNET_MODEL": NAME,
               "ANTHROPIC_DEFAULT_OPUS_MODEL": NAME}
        ran = subprocess.run([str(CLAUDE), "-p", "--output-format", "json", "--max-turns", "4",
                              "--model", NAME, prompt], cwd=work, env=env,
                             stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=360)
    return ran, seen


def _completed(ran: subprocess.CompletedProcess[str], pair: Server) -> dict[str, Any]:
    """Claude Code's result of a run that ended in its normal way, every request of it served."""
    assert ran.returncode == 0, (ran.stdout[-4000:], ran.stderr[-4000:], pair.logs())
    result = json.loads(ran.stdout)
    assert result["type"] == "result" and not result["is_error"], result
    served = [(line["msg"], line.get("error")) for line in pair.log_lines("proxy")
              if line["logger"] == "tether.access"
              and line.get("route") not in ("/health", "/metrics")]  # the test's own
    assert served and all(msg.startswith("POST /v1/messages") and msg.endswith(" 200")
                          for msg, _ in served), served
    assert_baseline(pair.metrics())
    return result  # type: ignore[no-any-return]


def test_claude_code_runs_a_turn_to_its_end(pair: Server, tmp_path: Path) -> None:
    ran, seen = _claude(pair, tmp_path, "Say hi.")
    result = _completed(ran, pair)
    assert 5_000 < result["usage"]["input_tokens"] + result["usage"].get(
        "cache_read_input_tokens", 0) < MAX_LEN - 1_024, result["usage"]  # its whole prompt
    first = seen[0]
    print("Claude Code sent:", json.dumps({**_summary(first), "usage": result["usage"]},
                                          indent=1))  # docs/endpoints.md
    # What docs/endpoints.md says it sends.
    body, headers = first["body"], {k.lower(): v for k, v in first["headers"].items()}
    assert first["path"] == "/v1/messages?beta=true" and body["stream"] is True
    assert headers["anthropic-version"] == "2023-06-01" and headers["x-api-key"] == KEY
    assert "claude-code-20250219" in headers["anthropic-beta"].split(",")
    assert body["max_tokens"] == 32000 and body["thinking"]["type"] == "adaptive"
    assert any("cache_control" in block for block in body["system"])
    assert any(m["role"] == "system" for m in body["messages"])
    assert {"context_management", "output_config", "metadata", "tools"} <= set(body)


def _summary(request: dict[str, Any]) -> dict[str, Any]:
    body = request["body"]
    return {"path": request["path"],
            "headers": {k: v for k, v in request["headers"].items()
                        if k.lower().startswith(("anthropic", "x-"))},
            "fields": sorted(body), "max_tokens": body.get("max_tokens"),
            "thinking": body.get("thinking"), "output_config": body.get("output_config"),
            "context_management": body.get("context_management"),
            "metadata": sorted(body.get("metadata", {})),
            "system": [sorted(block) for block in body.get("system", [])],
            "roles": [m["role"] for m in body["messages"]],
            "tools": len(body.get("tools", [])),
            "tool_fields": sorted({k for t in body.get("tools", []) for k in t}),
            "bytes": len(json.dumps(body))}


def test_a_tool_claude_code_runs_goes_there_and_back(pair: Server, tmp_path: Path) -> None:
    ran, seen = _claude(pair, tmp_path, "Which agents are there?", force=FORCED)
    _completed(ran, pair)
    assert len(seen) >= 2, [s["path"] for s in seen]
    later = seen[1]["body"]["messages"]
    [call] = [b for m in later if m["role"] == "assistant" and isinstance(m["content"], list)
              for b in m["content"] if b["type"] == "tool_use"]
    assert call["name"] == FORCED and isinstance(call["input"], dict)
    [answer] = [b for m in later if m["role"] == "user" and isinstance(m["content"], list)
                for b in m["content"] if b["type"] == "tool_result"]
    assert answer["tool_use_id"] == call["id"]
