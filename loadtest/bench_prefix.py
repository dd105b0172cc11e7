"""Prefix caching: a shared system prompt and a long Responses conversation, caching on vs off.

    python -m loadtest.bench_prefix [--model builtin:tiny] [--turns 10] [--repeats 3] [--out DIR]
                                    [--chain previous_response_id|conversation]

In one run, two server pairs on the same model one after the other: prefix caching on (the
default) and `--no-prefix-caching`. On each, one request at a time, so that counter deltas
belong to one request:
  system  two streamed chat requests that share a ~1.5k-token system prompt (unique per repeat,
          so repeats never warm each other): the second's prefilled prompt tokens
          (tether_prompt_tokens_total) as a share of the system prompt, its usage cached_tokens,
          and the TTFT (client-side, to the first content chunk) of both
  convo   a --turns-turn Responses conversation chained by previous_response_id, or with
          --chain conversation the turns of one Conversations-API conversation (streamed;
          TTFT to the first output_text.delta), each turn a ~80-token input and
          --output-tokens of output (ignore_eos): TTFT, prefilled and cached tokens per turn
Goals (caching on): the second request prefills <= 20% of the system prompt; TTFT of the last
turn <= 1.5x the first turn's (medians over --repeats). The off pair is today's behaviour.
Writes prefix.json and ttft_by_turn.png under results/bench-prefix-<timestamp>/ (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest import sse_client
from loadtest.metrics import scrape
from loadtest.pair import ServerPair, served_model
from loadtest.report import goal_line, plot_lines, results_dir, write_json

SYSTEM_GOAL = 0.2
TURN_GOAL = 1.5
SENTENCE = "Answer as a terse, careful assistant and cite the rule you follow. "


def system_prompt() -> str:
    return f"[{secrets.token_hex(4)}] " + SENTENCE * 23  # ~1.5k byte tokens


def turn_input(turn: int, tag: str) -> str:
    # The tag opens the conversation, so repeats never warm each other.
    return (f"[{tag}] " if turn == 1 else "") + f"Turn {turn}: " + "please go on, briefly. " * 3


async def streamed(base_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """TTFT and the final usage (and response id) of one streamed request."""
    t0 = time.monotonic()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    rid = None
    async with sse_client.stream(base_url, path, {**body, "stream": True}) as resp:
        async for data in resp.events():
            if data == b"[DONE]":
                continue
            event = orjson.loads(data)
            if ttft is None and sse_client.tokens_in_event(event):
                ttft = time.monotonic() - t0
            if isinstance(event.get("response"), dict):  # created ... completed/incomplete
                rid = event["response"]["id"]
                usage = event["response"].get("usage") or usage
            elif event.get("usage"):
                usage = event["usage"]
    # A random model can emit only textless tokens (special ids): then the end is the first.
    return {"ttft_s": ttft if ttft is not None else time.monotonic() - t0, "usage": usage,
            "id": rid}


def prefilled(base_url: str) -> float:
    return scrape(base_url).total("tether_prompt_tokens_total")


async def shared_system(base_url: str, model: str) -> dict[str, Any]:
    system = system_prompt()
    out: dict[str, Any] = {"system_tokens": len(system.encode())}
    for name, question in (("first", "What is one plus one?"), ("second", "Name a colour.")):
        before = prefilled(base_url)
        got = await streamed(base_url, "/v1/chat/completions", {
            "model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}],
            "stream_options": {"include_usage": True}})
        usage = got["usage"]
        out[name] = {"ttft_s": got["ttft_s"], "prompt_tokens": usage["prompt_tokens"],
                     "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                     "prefilled": prefilled(base_url) - before}
    out["second_prefill_share"] = out["second"]["prefilled"] / out["system_tokens"]
    return out


async def conversation(base_url: str, model: str, turns: int, output_tokens: int,
                       chain: str = "previous_response_id") -> list[dict[str, Any]]:
    previous: str | None = None
    rows: list[dict[str, Any]] = []
    tag = secrets.token_hex(4)
    conv = None
    if chain == "conversation":
        async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as client:
            conv = (await client.post("/v1/conversations", json={})).json()["id"]
    for turn in range(1, turns + 1):
        before = prefilled(base_url)
        body: dict[str, Any] = {"model": model, "input": turn_input(turn, tag), "temperature": 0,
                                "max_output_tokens": output_tokens, "ignore_eos": True}
        if conv:
            body["conversation"] = conv
        elif previous:
            body["previous_response_id"] = previous
        got = await streamed(base_url, "/v1/responses", body)
        previous = got["id"]
        usage = got["usage"]
        rows.append({"turn": turn, "ttft_s": got["ttft_s"], "input_tokens": usage["input_tokens"],
                     "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
                     "prefilled": prefilled(base_url) - before})
    return rows


async def measure(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    model = served_model(base_url) or args.model
    system = [await shared_system(base_url, model) for _ in range(args.repeats)]
    convos = [await conversation(base_url, model, args.turns, args.output_tokens, args.chain)
              for _ in range(args.repeats)]
    per_turn = [{"turn": t + 1,
                 **{k: statistics.median(c[t][k] for c in convos)
                    for k in ("ttft_s", "input_tokens", "cached_tokens", "prefilled")}}
                for t in range(args.turns)]
    return {
        "system": system,
        "second_prefill_share": statistics.median(s["second_prefill_share"] for s in system),
        "ttft_first_s": statistics.median(s["first"]["ttft_s"] for s in system),
        "ttft_second_s": statistics.median(s["second"]["ttft_s"] for s in system),
        "conversations": convos,
        "per_turn": per_turn,
        "last_over_first_ttft": per_turn[-1]["ttft_s"] / per_turn[0]["ttft_s"],
    }


def report(res: dict[str, Any]) -> None:
    on, off = res["on"], res["off"]
    tokens = on["system"][0]["system_tokens"]
    print(f"\n=== prefix caching (model {res['model']}, medians of {res['repeats']}) ===")
    print(f"  shared system prompt of {tokens} tokens, second request:   caching on     off")
    for label, key in (("prefilled share of the system prompt", "second_prefill_share"),):
        print(f"    {label:<46} {on[key]:>9.1%} {off[key]:>8.1%}")
    for label, key in (("TTFT first request (ms)", "ttft_first_s"),
                       ("TTFT second request (ms)", "ttft_second_s")):
        print(f"    {label:<46} {on[key] * 1e3:>9.1f} {off[key] * 1e3:>8.1f}")
    print(f"  {res['turns']}-turn Responses conversation (chained by {res['chain']}):")
    print(f"    {'turn':>4} {'input tok':>9} {'cached':>7} {'prefilled on/off':>17} "
          f"{'TTFT ms on':>11} {'off':>7}")
    for a, b in zip(on["per_turn"], off["per_turn"], strict=True):
        print(f"    {a['turn']:>4} {a['input_tokens']:>9.0f} {a['cached_tokens']:>7.0f} "
              f"{a['prefilled']:>8.0f}/{b['prefilled']:<8.0f} {a['ttft_s'] * 1e3:>11.1f} "
              f"{b['ttft_s'] * 1e3:>7.1f}")
    share = on["second_prefill_share"]
    print(goal_line("second request prefills (share of system)", share,
                    f"<= {SYSTEM_GOAL:.0%}", share <= SYSTEM_GOAL))
    ratio = on["last_over_first_ttft"]
    print(goal_line(f"TTFT turn {res['turns']} / turn 1, caching on", ratio,
                    f"<= {TURN_GOAL}", ratio <= TURN_GOAL, "x"))
    print(f"  (caching off: turn {res['turns']} / turn 1 = {off['last_over_first_ttft']:.2f}x)")


def plot(path: Path, res: dict[str, Any]) -> Path:
    turns = [row["turn"] for row in res["on"]["per_turn"]]
    series = {f"caching {k}": [row["ttft_s"] * 1e3 for row in res[k]["per_turn"]]
              for k in ("on", "off")}
    return plot_lines(path, turns, series, "turn", "TTFT (ms)",
                      f"Responses conversation TTFT by turn (model {res['model']})",
                      marker="o")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--chain", choices=("previous_response_id", "conversation"),
                        default="previous_response_id")
    args = parser.parse_args(argv)
    if args.turns < 2 or args.repeats < 1:
        parser.error("--turns must be >= 2 and --repeats >= 1")
    out = results_dir(args.out, "bench-prefix")
    res: dict[str, Any] = {"model": args.model, "turns": args.turns, "repeats": args.repeats,
                           "output_tokens": args.output_tokens, "chain": args.chain}
    for key, extra in (("on", []), ("off", ["--no-prefix-caching"])):
        with ServerPair(model=args.model, extra_args=extra) as pair:
            res[key] = asyncio.run(measure(pair.base_url, args))
    report(res)
    write_json(out / "prefix.json", res)
    plot(out / "ttft_by_turn.png", res)
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
