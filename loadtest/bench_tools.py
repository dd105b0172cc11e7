"""What a request's tools cost the proxy's event loop, at the bounds (issue 34, item 11).

    python -m loadtest.bench_tools [--reps 5] [--body-bytes 4194304] [--out DIR]

In process, no pair: each case is the synchronous work the route does on the loop for one body
(decode, the tools' checks, a forced call's grammar), timed over --reps (min and median, ms):
  chat-most    the most tools a body of --body-bytes holds (~80k), on chat: refused (400)
  ns-most      the same as one namespace on /v1/responses: refused (400)
  forced-max   MAX_TOOLS functions whose parameters fill the grammar's limit, tool_choice
               required: the grammar is built (objects closed, JSON written)
  schemas-max  the body filled with functions at the per-function limit, tool_choice auto
Goal: every case under 250 ms (a bystander stream's longest gap stays well under 1 s). Writes
tools.json under results/bench-tools-<timestamp>/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from ipc.records import ToolCallFormat
from proxy.bodies import decode_body
from proxy.guides import MAX_GUIDE_BYTES
from proxy.http.errors import ApiError
from proxy.openai.schemas import ChatRequest
from proxy.openai.tool_requests import MAX_TOOLS, chat_tool_use, tool_guide
from proxy.responses.request import parse_request, tool_use

GOAL_MS = 250.0
ASK = [{"role": "user", "content": "hi"}]


def _schema(size: int) -> dict[str, Any]:
    """An object schema of about `size` bytes of bounded string properties."""
    count = max(1, size // 45)  # each property: 43 bytes and a comma
    return {"type": "object", "properties": {
        f"p{j:05d}": {"type": "string", "maxLength": 8} for j in range(count)}}


def _most(limit: int, entry: Callable[[int], dict[str, Any]], wrap: Callable[[list[Any]], bytes],
          ) -> bytes:
    """The body of the most entries under `limit` bytes."""
    each = len(orjson.dumps(entry(0))) + 1
    count = (limit - len(wrap([]))) // each
    while True:
        body = wrap([entry(i) for i in range(count)])
        if len(body) <= limit:
            return body
        count -= 1 + (len(body) - limit) // each


def _chat(body: bytes) -> None:
    req = decode_body(body, ChatRequest)
    use = chat_tool_use(req.tools, req.tool_choice, req.parallel_tool_calls)
    if use is not None:
        tool_guide(use, ToolCallFormat.HERMES, None)


def _responses(body: bytes) -> None:
    req, _ = parse_request(body, ("m",))
    tool_use(req)


def cases(body_bytes: int) -> dict[str, tuple[Callable[[bytes], None], bytes]]:
    def chat_tools(tools: list[Any], **extra: Any) -> bytes:
        return orjson.dumps({"messages": ASK, "tools": tools, **extra})

    def fn(i: int, schema: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"type": "function", "function": {"name": f"f{i:05d}", **(
            {"parameters": schema} if schema is not None else {})}}

    def namespace(tools: list[Any]) -> bytes:
        return orjson.dumps({"input": "hi", "model": "m", "tools": [
            {"type": "namespace", "name": "many", "tools": tools}]})

    per_tool = _schema(MAX_GUIDE_BYTES // MAX_TOOLS - 64)
    full = _schema(MAX_GUIDE_BYTES - 1024)
    return {
        "chat-most": (_chat, _most(body_bytes, fn, chat_tools)),
        "ns-most": (_responses, _most(body_bytes, lambda i: {"type": "function",
                                                             "name": f"f{i:05d}"}, namespace)),
        "forced-max": (_chat, chat_tools([fn(i, per_tool) for i in range(MAX_TOOLS)],
                                         tool_choice="required")),
        "schemas-max": (_chat, _most(body_bytes, lambda i: fn(i, full), chat_tools)),
    }


def measure(run: Callable[[bytes], None], body: bytes, reps: int) -> dict[str, Any]:
    times, refused = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        try:
            run(body)
            refused = None
        except ApiError as e:
            refused = e.message
        times.append((time.perf_counter() - t0) * 1000)
    return {"body_bytes": len(body), "min_ms": min(times), "median_ms": statistics.median(times),
            "refused": refused}


def main(argv: Sequence[str] | None = None) -> int:
    from loadtest.report import goal_line, results_dir, write_json

    ap = argparse.ArgumentParser(prog="python -m loadtest.bench_tools",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--body-bytes", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    figures = {name: measure(run, body, args.reps)
               for name, (run, body) in cases(args.body_bytes).items()}
    lines = []
    for name, f in figures.items():
        lines.append(goal_line(f"{name} ({f['body_bytes']:,} B)", f["median_ms"],
                               f"< {GOAL_MS:.0f} ms", f["median_ms"] < GOAL_MS, " ms"))
        if f["refused"]:
            lines.append(f"    400: {f['refused'][:120]}")
    print("\n".join(lines))
    path = write_json(results_dir(args.out, "bench-tools") / "tools.json",
                      {"args": vars(args), "figures": figures, "report": lines})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
