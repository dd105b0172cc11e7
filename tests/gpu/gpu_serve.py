"""Sections c (--gpu-memory-utilization, 256 streams), d (the abort benchmark) and f
(structured outputs and tool calls) of gpu_check.py: real `tether serve` pairs, real FIFOs and
sockets."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from gpu_case import Case
from gpu_engine import KEPT, Left, checkpoint

from loadtest import sse_client
from loadtest.metrics import scrape
from loadtest.pair import ServerPair, served_model, tether_command

REPO = Path(__file__).resolve().parents[2]
UTILIZATION = 0.85
GIB = float(1 << 30)


def serve_args(case: Case) -> list[str]:
    return ["--device", case.device, "--dtype", case.dtype_name]


class FreeMemory:
    """The device's free memory, sampled every 20 ms in a thread: its minimum while running."""

    def __init__(self, device: str) -> None:
        self.on = device == "cuda"
        self.least: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> FreeMemory:
        if self.on:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.on:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            free = torch.cuda.mem_get_info()[0]
            self.least = free if self.least is None else min(self.least, free)
            time.sleep(0.02)


# --- c: memory ---------------------------------------------------------------------------------


def memory(case: Case, left: Left) -> dict[str, Any]:
    model = checkpoint(case)
    KEPT.clear()  # what this process holds on the GPU would be missing to the server
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out: dict[str, Any] = {"model": model, "streams": case.serve_streams}
    if case.device == "cuda":
        sizing = ["--gpu-memory-utilization", str(UTILIZATION)]
        free0, total = torch.cuda.mem_get_info()
        out.update(utilization=UTILIZATION, total_gib=total / GIB,
                   free_before_gib=free0 / GIB, allowed_gib=total * UTILIZATION / GIB)
    else:
        out["cpu_refusal"] = refusal()
        sizing = ["--kv-cache-blocks", "512"]
        free0 = 0
    pair = ServerPair(model=model, max_num_seqs=case.serve_streams,
                      extra_args=[*serve_args(case), *sizing],
                      startup_timeout=max(30.0, min(180.0, left() - 20)))
    with FreeMemory(case.device) as free:
        t0 = time.monotonic()
        pair.start()
        out["startup_s"] = time.monotonic() - t0
        try:
            out.update(asyncio.run(streams(pair.base_url, case.serve_streams)))
            out["kv_blocks_total"] = scrape(pair.base_url).total(
                "tether_kv_cache_blocks_total")
            out["server_alive"] = pair.proc is not None and pair.proc.poll() is None
            log = pair.log_path.read_text(errors="replace")
        finally:
            pair.stop()
    out["log"] = [line for line in log.splitlines()
                  if "gpu-memory-utilization" in line or "CUDA graphs" in line
                  or "KV blocks" in line or "out of memory" in line.lower()]
    oom = "out of memory" in log.lower()
    if free.least is not None:
        out["server_peak_gib"] = (free0 - free.least) / GIB
        out["within_allowed"] = out["server_peak_gib"] <= out["allowed_gib"] + 1.0  # + contexts
    out["passed"] = (out["errors"] == 0 and out["server_alive"] and not oom
                     and out.get("within_allowed", True) and out.get("cpu_refusal", {})
                     .get("ok", True))
    out["headline"] = (f"{case.serve_streams} streams: {out['errors']} errors, "
                       f"{out['tok_s']:.0f} tok/s, {out['kv_blocks_total']:.0f} KV blocks"
                       + (f", server peak {out['server_peak_gib']:.1f} of "
                          f"{out['allowed_gib']:.1f} GiB allowed" if "server_peak_gib" in out
                          else "") + (", OOM in the log" if oom else ""))
    return out


def refusal() -> dict[str, Any]:
    """On the CPU the setting is refused at start, with a message naming it."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [*tether_command(), "daemon", "--device", "cpu", "--model", "builtin:tiny",
             "--gpu-memory-utilization", "0.5", "--runtime-dir", f"{tmp}/run",
             "--state-dir", f"{tmp}/state"],
            capture_output=True, text=True, timeout=120, cwd=REPO,
            env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    said = (proc.stderr + proc.stdout).strip().splitlines()
    message = next((line for line in said if "--gpu-memory-utilization" in line), "")
    return {"exit": proc.returncode, "message": message[-300:],
            "ok": proc.returncode == 1 and "--kv-cache-blocks" in message}


async def streams(base: str, n: int, prompt_chars: int = 200, new_tokens: int = 256
                  ) -> dict[str, Any]:
    """n non-streaming completions at once; every one must bring back all its tokens."""
    model = served_model(base) or "default"

    async def one(i: int) -> int | None:
        body = {"model": model, "prompt": f"{i} " + "w" * prompt_chars,
                "max_tokens": new_tokens, "ignore_eos": True, "temperature": 0.0}
        status, obj = await sse_client.call_json(base, "POST", "/v1/completions", body)
        if status != 200 or not obj:
            return None
        return int(obj["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    done = [g for g in got if g == new_tokens]
    return {"new_tokens": new_tokens, "errors": n - len(done), "wall_s": wall,
            "tok_s": sum(done) / wall}


# --- d: the abort benchmark --------------------------------------------------------------------


def abort(case: Case, left: Left) -> dict[str, Any]:
    model = checkpoint(case)
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "loadtest.bench_abort", "--serve-model",
                model, "--serve-args", shlex.join([*serve_args(case), "--kv-cache-blocks",
                                                   "4096"]),
                *case.abort_args, "--out", tmp]
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO,
                              timeout=max(10.0, left() - 5))
        report = proc.stdout[-4000:]
        if proc.returncode != 0:
            raise RuntimeError(f"bench_abort exited {proc.returncode}:\n{report}\n"
                               f"{proc.stderr[-3000:]}")
        results = json.loads((Path(tmp) / "abort.json").read_text())
    stream, queued = results["stream"], results["queued"]
    tick = results["tick_s"]
    latency = stream.get("server_abort_latency_s") or {}
    ticks_bucket = stream.get("server_abort_ticks_p99")
    out = {"model": model, "args": list(case.abort_args),
           "tick_ms": None if tick is None else tick * 1e3,
           "abort_latency_ms": {k: (v * 1e3 if isinstance(v, float) and k != "count" else v)
                                for k, v in latency.items()},
           "ticks_before_eviction_p99_bucket": ticks_bucket,
           "tokens_after_disconnect": stream["server_tokens_after_disconnect"],
           "waste_tokens": stream["waste_tokens"],
           "prefill_tokens_of_queued_drops": queued.get("prefill_tokens_of_dropped"),
           "goodput": results["churn"].get("goodput"), "report": report.splitlines()}
    p99 = latency.get("p99")
    out["goals"] = {
        "ticks <= 1": ticks_bucket is not None and ticks_bucket[1] <= 1,
        "latency p99 <= tick + 2 ms": (None if p99 is None or tick is None
                                       else p99 <= tick + 0.002),
        "queued prefill == 0": queued.get("prefill_tokens_of_dropped") == 0}
    shown = "not measured" if tick is None else f"{tick * 1e3:.2f} ms"
    out["headline"] = (f"tick {shown}, ticks p99 bucket {ticks_bucket}, latency "
                       f"p99 {p99 * 1e3 if p99 is not None else float('nan'):.2f} ms, queued "
                       f"prefill {out['prefill_tokens_of_queued_drops']}, goodput "
                       f"{out['goodput']}")
    return out


# --- f: structured outputs and tool calls ------------------------------------------------------

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}


def guided(case: Case, left: Left) -> dict[str, Any]:
    """loadtest/bench_structured.py's validity (random schemas asked once each) and overhead
    (constrained against unconstrained tokens/s in closed loops) over a real pair of the 1B
    checkpoint, whose 128k-wide logits take the grammar's bitmask on the device; and one forced
    tool call (its chat template teaches Hermes' format)."""
    from loadtest import bench_structured  # jsonschema: the other sections run without it

    model = checkpoint(case)
    knobs = argparse.Namespace(tokens=case.guided_tokens, reps=case.guided_reps,
                               window_s=case.guided_window_s)
    out: dict[str, Any] = {"model": model, "streams": case.guided_streams, **vars(knobs)}
    pair = ServerPair(model=model, max_num_seqs=case.guided_streams,
                      extra_args=[*serve_args(case), "--kv-cache-blocks", "4096"],
                      startup_timeout=max(30.0, min(180.0, left() - 20)))
    with pair:
        base = pair.base_url
        name = served_model(base) or model
        out["validity"] = asyncio.run(bench_structured.validity(base, name,
                                                                case.guided_schemas, 0))
        out["tool_call"] = asyncio.run(forced_tool_call(base, name))
        out["overhead"] = asyncio.run(bench_structured.overhead(
            base, name, case.guided_streams, knobs, pair.processes()["daemon"]))
        out["compile"] = bench_structured.compile_figures(base)
    valid, cost = out["validity"], out["overhead"]
    rate = cost["median_tok_per_s"]
    out["goals"] = {"valid == 100%": valid["valid_rate"] == 1.0,
                    "overhead <= 10%": cost["overhead"] <= bench_structured.OVERHEAD_GOAL}
    out["passed"] = (valid["valid_rate"] == 1.0 and not valid["refused_otherwise"]
                     and out["tool_call"]["ok"])
    out["headline"] = (f"{valid['valid']}/{valid['answered']} valid, forced tool call "
                       f"{'ok' if out['tool_call']['ok'] else 'FAILED'}; "
                       f"{case.guided_streams} streams: {rate['constrained']:.0f} tok/s "
                       f"constrained vs {rate['unconstrained']:.0f} free "
                       f"({100 * cost['overhead']:.1f}% slower)")
    return out


async def forced_tool_call(base: str, model: str) -> dict[str, Any]:
    """tool_choice required: the answer is a call of the one tool, its arguments valid."""
    from loadtest.bench_structured import conforms

    body = {"model": model, "max_tokens": 200, "temperature": 1.0, "tool_choice": "required",
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [{"type": "function", "function": {
                "name": "get_weather", "parameters": WEATHER, "strict": True}}]}
    status, obj = await sse_client.call_json(base, "POST", "/v1/chat/completions", body)
    if status != 200 or not obj:
        return {"status": status, "ok": False, "answer": str(obj)[:500]}
    choice = obj["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    ok = (choice["finish_reason"] == "tool_calls" and bool(calls)
          and all(c["function"]["name"] == "get_weather"
                  and conforms(c["function"]["arguments"], WEATHER) for c in calls))
    return {"status": status, "finish": choice["finish_reason"], "calls": calls, "ok": ok}
