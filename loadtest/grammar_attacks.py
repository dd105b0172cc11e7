"""Grammar attacks beside a bystander stream (issue 34, items 9, 10, 12), for
loadtest/bench_structured.py: each attack runs on a fresh `tether serve` pair on sim:20 while
one client streams an unconstrained completion, and is measured by what the client sees — the
bystander's longest wait between two tokens, the attack's answers and how long they took — and
by whether the daemon is still the process it was (the launcher's watchdog replaces a daemon
whose tick stalls past 30 s).

  nested     the 60-byte grammar whose closing search walked 4,096 bytes on the tick
  no_close   six at once of a grammar with no closing the search knows (each its own text)
  ambiguous  an ambiguous grammar, n=8, 300 tokens: each token's parse grew with the output
  ambiguous_x4  four of them at once: 32 sequences, all the pair runs at once
  compiles   three schemas of 8,000 optional properties, then a one-property schema
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import orjson

from loadtest import sse_client
from loadtest.pair import ServerPair

SIM = "sim:20"
BYSTANDER = {"prompt": "a bystander", "max_tokens": 30_000, "ignore_eos": True,
             "temperature": 0, "stream": True}
ATTACK_TIMEOUT_S = 240.0


def _grammar(text: str, **extra: Any) -> dict[str, Any]:
    return {"prompt": "a", "max_tokens": 50, "guided_grammar": text, **extra}


def _optional(i: int, count: int) -> dict[str, Any]:
    props = {f"p{i}_{k}": {"type": "string"} for k in range(count)}
    return {"prompt": "a", "max_tokens": 20, "guided_json": {"type": "object",
                                                             "properties": props}}


CHEAP = {"prompt": "a", "max_tokens": 20, "guided_json": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}

AMBIGUOUS = _grammar('start: e\ne: e e e | e e | /[a-z]/ | ""\n', max_tokens=300, n=8)
ATTACKS: dict[str, list[dict[str, Any]]] = {
    "nested": [_grammar('start: "(" e ")"\ne: e e | "(" e ")" | /[a-z]/ | ""\n')],
    "no_close": [_grammar(f'start: "<{i}" e "!"\ne: /[a-z]/ e | ""\n') for i in range(6)],
    "ambiguous": [AMBIGUOUS],
    "ambiguous_x4": [AMBIGUOUS] * 4,
    "compiles": [_optional(i, 8000) for i in range(3)],
}


async def _bystander(base: str, gaps: list[float], streaming: asyncio.Event,
                     stop: asyncio.Event) -> None:
    """Streams until `stop`, each gap between two events into `gaps`; `streaming` once ten
    came."""
    last: float | None = None
    async with sse_client.stream(base, "/v1/completions", BYSTANDER) as r:
        async for _event in r.events():
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            if len(gaps) >= 10:
                streaming.set()
            if stop.is_set():
                return


async def _one(base: str, body: dict[str, Any]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        status, out = await asyncio.wait_for(
            sse_client.call_json(base, "POST", "/v1/completions", body), ATTACK_TIMEOUT_S)
    except (TimeoutError, OSError, sse_client.HttpError) as exc:
        return {"status": None, "error": type(exc).__name__,
                "seconds": time.monotonic() - start}
    error = (out or {}).get("error") or {}
    return {"status": status, "code": error.get("code"), "seconds": time.monotonic() - start}


async def _attack(base: str, name: str) -> dict[str, Any]:
    gaps: list[float] = []
    streaming, stop = asyncio.Event(), asyncio.Event()
    stream = asyncio.create_task(_bystander(base, gaps, streaming, stop))
    await asyncio.wait_for(streaming.wait(), 60)  # the attack begins beside a stream
    answers = [asyncio.create_task(_one(base, body)) for body in ATTACKS[name]]
    cheap = None
    if name == "compiles":  # sent after the slow ones: does it wait behind them?
        await asyncio.sleep(1.0)
        cheap = await _one(base, CHEAP)
    done = await asyncio.gather(*answers)
    stop.set()
    await asyncio.wait_for(stream, 60)
    return {"answers": dict(Counter(f"{a['status']} {a.get('code') or a.get('error') or ''}"
                                    .strip() for a in done)),
            "attack_s": max(a["seconds"] for a in done), "cheap": cheap,
            "bystander_max_gap_s": max(gaps, default=None), "bystander_tokens": len(gaps) + 1}


def run_attacks(names: list[str]) -> list[dict[str, Any]]:
    """Each attack on a pair of its own (one that froze its daemon leaves nothing behind)."""
    results = []
    for name in names:
        with ServerPair(SIM, max_num_seqs=32) as pair:
            before = pair.processes()["daemon"].pid
            out = asyncio.run(_attack(pair.base_url, name))
            after = pair.processes().get("daemon")  # none: gone, and not back yet
            out["daemon_replaced"] = after is None or after.pid != before
        results.append({"attack": name, **out})
        print(orjson.dumps(results[-1]).decode(), flush=True)
    return results


def attack_lines(results: list[dict[str, Any]]) -> list[str]:
    lines = ["grammar attacks beside a bystander stream (sim:20):"]
    for r in results:
        gap = r["bystander_max_gap_s"]
        cheap = r["cheap"]
        lines.append(
            f"  {r['attack']:<12} bystander's longest gap "
            + ("n/a" if gap is None else f"{gap:.2f} s")
            + f", attack answered {r['answers']} within {r['attack_s']:.1f} s"
            + ("" if cheap is None else f", the cheap schema {cheap['status']} "
               f"{cheap.get('code') or ''} in {cheap['seconds']:.2f} s")
            + (", DAEMON REPLACED" if r["daemon_replaced"] else ""))
    return lines
