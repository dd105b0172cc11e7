"""Structured outputs: valid within the budget, and what the constraint costs.

    python -m loadtest.bench_structured [--schemas 300] [--streams 8,64] [--tokens 256]
                                        [--reps 3] [--models builtin:tiny,sim:0]
                                        [--attacks nested,no_close,ambiguous,ambiguous_x4,compiles]
                                        [--out DIR]

Figures, all measured in this run:
  validity   --schemas random JSON schemas (bounded strings, enums, integer ranges, nested
             objects and arrays, and unbounded strings and numbers that only the budget ends),
             each asked once over HTTP (chat, response_format json_schema) on builtin:tiny at
             temperature 1, a random budget each: the share of answers that parse and validate
             (jsonschema), the finish reasons, and the budgets refused up front (a 400 naming
             max_tokens: no valid output fits)
  overhead   tokens/s of S clients in a closed loop asking for an extraction (a summary of up
             to --tokens) under its JSON schema, against the same chat requests unconstrained
             (ignore_eos, each answer's length drawn from the constrained ones'): the
             daemon's generated tokens over --window-s after a second of warm-up, interleaved,
             median of --reps, at each --streams, on each model
  compile    the daemon's compile times (tether_grammar_compile_seconds) and cache hits over
             the run, and the first-token latency of a new schema against the same one cached
  attacks    grammars a hostile client chooses, each beside a bystander stream on sim:20: the
             bystander's longest gap between two tokens, the attack's answers, whether the
             daemon was replaced (loadtest/grammar_attacks.py); an empty --models or
             --attacks skips that part
Goals: 100% valid and no `length` ending; constrained tokens/s within 10% of unconstrained at
8 and 64 streams; under each attack the bystander's longest gap under 1 s and the daemon the
same process. Writes structured.json under results/bench-structured-<timestamp>/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import jsonschema
import psutil

from loadtest import sse_client
from loadtest.grammar_attacks import ATTACKS, attack_lines, run_attacks
from loadtest.metrics import scrape
from loadtest.pair import ServerPair, served_model
from loadtest.report import goal_line, results_dir, summary, write_json

MESSAGES = [{"role": "user", "content": "Describe it as JSON."}]
VALIDITY_CONCURRENCY = 8
OVERHEAD_GOAL = 0.10


# --- random schemas ------------------------------------------------------------------------------


def random_leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.randrange(7)
    if kind == 0:
        return {"type": "string", "maxLength": rng.randint(0, 12)}
    if kind == 1:
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == 2:
        return {"type": "boolean"}
    if kind == 3:
        return {"type": "number"}  # unbounded: only the budget ends it
    if kind == 4:
        return {"type": "string"}
    if kind == 5:
        return {"type": "integer"}
    words = ["".join(rng.choices("abcxyz", k=rng.randint(1, 6))) for _ in range(4)]
    return {"enum": sorted(set(words))}


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object of one to four properties, some required, nested up to three levels."""
    props: dict[str, Any] = {}
    for _ in range(rng.randint(1, 4)):
        name = "".join(rng.choices("abcdefgh", k=rng.randint(1, 5)))
        roll = rng.random() if depth < 3 else 1.0
        if roll < 0.2:
            props[name] = random_schema(rng, depth + 1)
        elif roll < 0.35:
            props[name] = {"type": "array", "maxItems": rng.randint(0, 4),
                           "items": random_leaf(rng) if rng.random() < 0.6
                           else random_schema(rng, depth + 1)}
        else:
            props[name] = random_leaf(rng)
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": [n for n in props if rng.random() < 0.6]}


def chat_body(model: str, schema: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 1.0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "answer", "schema": schema}}}


# --- validity ------------------------------------------------------------------------------------


def conforms(text: str | None, schema: dict[str, Any]) -> bool:
    """The text parses as JSON that validates against the schema."""
    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def _ask(base: str, model: str, schema: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    status, body = await sse_client.call_json(base, "POST", "/v1/chat/completions",
                                              chat_body(model, schema, max_tokens))
    if status != 200:
        error = (body or {}).get("error") or {}
        return {"status": status, "param": error.get("param"), "message": error.get("message")}
    choice = body["choices"][0]
    text = choice["message"]["content"]
    valid = conforms(text, schema)
    return {"status": 200, "finish": choice["finish_reason"], "valid": valid,
            "tokens": body["usage"]["completion_tokens"], "max_tokens": max_tokens,
            **({} if valid else {"text": text, "schema": schema})}


async def validity(base: str, model: str, count: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    jobs = [(random_schema(rng), rng.randint(8, 200)) for _ in range(count)]
    gate = asyncio.Semaphore(VALIDITY_CONCURRENCY)

    async def one(schema: dict[str, Any], max_tokens: int) -> dict[str, Any]:
        async with gate:
            return await _ask(base, model, schema, max_tokens)

    results = await asyncio.gather(*(one(s, m) for s, m in jobs))
    answered = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] != 200]
    return {
        "schemas": count, "answered": len(answered),
        "valid": sum(1 for r in answered if r["valid"]),
        "valid_rate": sum(1 for r in answered if r["valid"]) / len(answered) if answered else None,
        "finish_reasons": dict(Counter(r["finish"] for r in answered)),
        "refused_naming_max_tokens": sum(1 for r in refused if r["param"] == "max_tokens"),
        "refused_otherwise": [r for r in refused if r["param"] != "max_tokens"],
        "invalid": [r for r in answered if not r["valid"]],
        "completion_tokens": summary([r["tokens"] for r in answered]),
    }


# --- overhead ------------------------------------------------------------------------------------


def overhead_schema(tokens: int) -> dict[str, Any]:
    """What an extraction asks for, about `tokens` bytes of compact JSON: a title, a score, tags
    from a list, and a summary whose bound sets the length (a random model rarely closes a
    string before its bound)."""
    return {"type": "object", "additionalProperties": False,
            "required": ["title", "score", "tags", "summary"],
            "properties": {"title": {"type": "string", "maxLength": 24},
                           "score": {"type": "integer", "minimum": 0, "maximum": 100},
                           "tags": {"type": "array", "maxItems": 4,
                                    "items": {"enum": ["news", "sport", "science", "art"]}},
                           "summary": {"type": "string", "maxLength": max(1, tokens - 100)}}}


class Loop(NamedTuple):
    tok_per_s: float
    cpu_us_per_token: float  # the daemon's CPU time (all its threads) per generated token
    tokens_per_answer: float


async def _closed_loop(base: str, body: dict[str, Any], streams: int, warm_s: float,
                       window_s: float, daemon: psutil.Process,
                       lengths_from: Sequence[int] = ()) -> tuple[Loop, list[int]]:
    """`streams` clients each sending `body` again as soon as it is answered: the daemon's
    generated-token counter and CPU time over a window after a warm-up (the ramps do not
    count), and the completion tokens of every answer. With `lengths_from`, each request's
    max_tokens is drawn from it (answers of one length would finish, and leave the batch
    empty while their clients send again, all at once)."""
    stop = asyncio.Event()
    want = "length" if body.get("ignore_eos") else "stop"
    lengths: list[int] = []
    rng = random.Random(0)

    async def client() -> None:
        while not stop.is_set():
            sent = {**body, "max_tokens": rng.choice(lengths_from)} if lengths_from else body
            status, out = await sse_client.call_json(base, "POST", "/v1/chat/completions",
                                                     sent)
            if status != 200 or out["choices"][0]["finish_reason"] != want:
                raise RuntimeError(f"HTTP {status}: {str(out)[:300]}")
            lengths.append(out["usage"]["completion_tokens"])

    tasks = [asyncio.create_task(client()) for _ in range(streams)]
    try:
        await asyncio.sleep(warm_s)
        before, cpu = scrape(base).total("tether_generation_tokens_total"), _cpu_s(daemon)
        start = time.perf_counter()
        await asyncio.sleep(window_s)
        generated = scrape(base).total("tether_generation_tokens_total") - before
        cpu = _cpu_s(daemon) - cpu
        elapsed = time.perf_counter() - start
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return Loop(generated / elapsed, 1e6 * cpu / max(generated, 1),
                statistics.mean(lengths)), lengths


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


async def overhead(base: str, model: str, streams: int, args: argparse.Namespace,
                   daemon: psutil.Process) -> dict[str, Any]:
    """Each rep: the constrained loop, then the unconstrained one, each answer's length drawn
    from those the constrained answers had (a request's own costs, its prompt and its HTTP
    exchange, then weigh the same per token)."""
    guided = chat_body(model, overhead_schema(args.tokens), 4 * args.tokens)
    plain = {"model": model, "messages": MESSAGES, "ignore_eos": True, "temperature": 1.0}
    loops: dict[str, list[Loop]] = {"constrained": [], "unconstrained": []}
    for _ in range(args.reps):
        loop, lengths = await _closed_loop(base, guided, streams, 1.0, args.window_s, daemon)
        loops["constrained"].append(loop)
        free, _ = await _closed_loop(base, plain, streams, 1.0, args.window_s, daemon, lengths)
        loops["unconstrained"].append(free)
    rate = {k: statistics.median(x.tok_per_s for x in v) for k, v in loops.items()}
    cpu = {k: statistics.median(x.cpu_us_per_token for x in v) for k, v in loops.items()}
    return {"streams": streams, "loops": {k: [x._asdict() for x in v] for k, v in loops.items()},
            "median_tok_per_s": rate, "median_cpu_us_per_token": cpu,
            "overhead": 1 - rate["constrained"] / rate["unconstrained"],
            "cpu_overhead": cpu["constrained"] / cpu["unconstrained"] - 1}


# --- compile ------------------------------------------------------------------------------------


async def _first_token_s(base: str, body: dict[str, Any]) -> float:
    start = time.perf_counter()
    async with sse_client.stream(base, "/v1/chat/completions", {**body, "stream": True}) as r:
        async for _event in r.events():
            return time.perf_counter() - start
    raise RuntimeError("no event")


async def compile_latency(base: str, model: str, seed: int) -> dict[str, Any]:
    """First-token latency of a fresh, sizeable schema, then of the same one again (cached)."""
    rng = random.Random(seed)
    schema = {"type": "object", "properties": {f"p{i}": random_schema(rng) for i in range(60)}}
    body = chat_body(model, schema, 64)
    fresh = await _first_token_s(base, body)
    cached = await _first_token_s(base, body)
    return {"schema_bytes": len(json.dumps(schema)), "first_token_new_s": fresh,
            "first_token_cached_s": cached}


def compile_figures(base: str) -> dict[str, Any]:
    m = scrape(base)
    hist = m.histogram("tether_grammar_compile_seconds")
    return {"compiles": m.total("tether_grammar_compiles_total"),
            "cache_hits": m.total("tether_grammar_cache_hits_total"),
            "cache_bytes": m.total("tether_grammar_cache_bytes"),
            "compile_s_mean": hist.sum / hist.count if hist and hist.count else None,
            "compile_s_p50": hist.quantile(0.5) if hist else None,
            "compile_s_p99": hist.quantile(0.99) if hist else None}


# --- the run -------------------------------------------------------------------------------------


def run_model(model: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model}
    with ServerPair(model, max_num_seqs=max(args.streams)) as pair:
        base = pair.base_url
        name = served_model(base) or model
        if model == args.validity_model:
            out["validity"] = asyncio.run(validity(base, name, args.schemas, args.seed))
            out["compile_latency"] = asyncio.run(compile_latency(base, name, args.seed))
        daemon = pair.processes()["daemon"]
        out["overhead"] = [asyncio.run(overhead(base, name, s, args, daemon))
                           for s in args.streams]
        out["compile"] = compile_figures(base)
    return out


def report(runs: list[dict[str, Any]]) -> list[str]:
    lines = []
    for run in runs:
        lines.append(f"{run['model']}:")
        v = run.get("validity")
        if v is not None:
            lines.append(f"  random schemas: {v['answered']} answered, {v['valid']} valid, "
                         f"finish {v['finish_reasons']}, {v['refused_naming_max_tokens']} "
                         "refused up front (max_tokens too small)")
            lines.append(goal_line("valid outputs", 100 * (v["valid_rate"] or 0), "100%",
                                   v["valid_rate"] == 1.0, "%"))
            lengths = v["finish_reasons"].get("length", 0)
            lines.append(goal_line("length endings", lengths, "0", lengths == 0))
            c = run["compile_latency"]
            lines.append(f"  first token, a new {c['schema_bytes']}-byte schema "
                         f"{1000 * c['first_token_new_s']:.1f} ms, cached "
                         f"{1000 * c['first_token_cached_s']:.1f} ms")
        for o in run["overhead"]:
            med = o["median_tok_per_s"]
            cpu = o["median_cpu_us_per_token"]
            lines.append(f"  {o['streams']} streams: {med['unconstrained']:.0f} tok/s free, "
                         f"{med['constrained']:.0f} constrained; daemon CPU per token "
                         f"{cpu['unconstrained']:.0f} vs {cpu['constrained']:.0f} us "
                         f"({100 * o['cpu_overhead']:+.1f}%)")
            lines.append(goal_line(f"overhead at {o['streams']} streams", 100 * o["overhead"],
                                   "<= 10%", o["overhead"] <= OVERHEAD_GOAL, "%"))
        c = run["compile"]
        mean = c["compile_s_mean"]
        lines.append(f"  compiles {c['compiles']:.0f}, cache hits {c['cache_hits']:.0f}, "
                     f"cache {c['cache_bytes'] / 1024:.0f} KiB, compile mean "
                     + ("n/a" if mean is None else f"{1000 * mean:.2f} ms"))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench_structured",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--schemas", type=int, default=300)
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=6.0)
    names = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--models", type=names, default=["builtin:tiny", "sim:0"])
    ap.add_argument("--attacks", type=names, default=list(ATTACKS))
    ap.add_argument("--validity-model", default="builtin:tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    runs = [run_model(model, args) for model in args.models]
    attacks = run_attacks(args.attacks)
    lines = report(runs) + (attack_lines(attacks) if attacks else [])
    print("\n".join(lines))
    path = write_json(results_dir(args.out, "bench-structured") / "structured.json",
                      {"args": vars(args), "runs": runs, "attacks": attacks, "report": lines})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
