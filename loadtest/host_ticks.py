"""The daemon's engine alone, in this process: host time of a decode tick on `sim:0`.

    python loadtest/host_ticks.py   # JSON lines in ({"streams": N, "ticks": T}), out (figures)

Run by its path, not as `loadtest.host_ticks`: it imports nothing of loadtest/, only daemon/
and ipc/, so that `PYTHONPATH=<another checkout>` measures that checkout's engine with this
file (bench_host.py's --against). The engine is built as `tether daemon` builds it for
`--model sim:0` (SimRunner, a store, guidance); N completions of `max_tokens` tokens with
ignore_eos (temperature 1: the sampler's drawing path, as a client that sets nothing gets)
are admitted, then T ticks are timed once every sequence decodes. `measure(build=...)` times
another runner's engine the same way (tests/gpu/gpu_host.py: the daemon's CUDA runner).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from daemon.engine.core import Engine, Runner
from daemon.engine.grammar import Grammars
from daemon.engine.guided import Guidance
from daemon.model import sim
from daemon.model.tokenizer import Tokenizer
from daemon.responses.store import ResponseStore
from ipc.records import RequestKind, SamplingParams, Submit

PROMPT = "Tell me a story about a host that did too much work per token."


def blocks_for(streams: int) -> int:
    return streams * 24 + 64  # a 64-byte prompt and 256 tokens take 20 blocks of 16


def engine_around(runner: Runner, tokenizer: Tokenizer, streams: int, store_dir: Path,
                  max_model_len: int, name: str) -> Engine:
    """The engine as daemon/main.py builds it around a runner (a store, guidance), sized for
    `streams` sequences."""
    store = ResponseStore(store_dir / "responses.db", 1000, 3600.0, max_bytes=1 << 30,
                          replica_id="bench", lease_s=30.0)
    grammars = Grammars(tokenizer, tokenizer.special_token_ids)
    return Engine(runner, tokenizer, store, max(streams, 1), max(512, 2 * streams),
                  max_model_len, name, guidance=Guidance(grammars, 10.0),
                  max_seqs_per_request=streams)


def build_engine(streams: int, store_dir: Path) -> Engine:
    """As daemon/main.py builds it for `--model sim:0`."""
    tokenizer = sim.SimTokenizer()
    runner = sim.SimRunner(tokenizer, blocks_for(streams), 0.0)
    return engine_around(runner, tokenizer, streams, store_dir, sim.SIM_MAX_MODEL_LEN, "sim:0")


def measure(streams: int, ticks: int, max_tokens: int = 256,
            build: Callable[[int, Path], Engine] = build_engine) -> dict[str, Any]:
    """Wall and CPU seconds of `ticks` decode ticks with `streams` sequences decoding, on the
    engine `build` makes (sim:0's by default)."""
    with tempfile.TemporaryDirectory(prefix="tether-host-") as tmp:
        engine = build(streams, Path(tmp))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        for i in range(streams):
            engine.submit(Submit(rid=f"r{i}", kind=RequestKind.COMPLETION, sampling=params,
                                 prompts=[PROMPT]))
        warm = 0
        while len(engine.scheduler.running) < streams or engine.scheduler.turns.num_waiting:
            engine.step()
            warm += 1
        for _ in range(4):  # past the prefill ticks
            engine.step()
        if warm + 4 + ticks >= max_tokens:
            raise ValueError(f"{ticks} ticks do not fit in {max_tokens} tokens after the warm-up")
        walls: list[float] = []
        records = 0
        # The engine's own time per phase of its step (a tree before the phases has none).
        phase_seconds = getattr(engine.figures, "phase_seconds", [])
        phase_ticks: list[list[float]] = []
        cpu0 = time.process_time()
        for _ in range(ticks):
            before = list(phase_seconds)
            t0 = time.perf_counter()
            records += len(engine.step())
            walls.append(time.perf_counter() - t0)
            phase_ticks.append([t - b for t, b in zip(phase_seconds, before, strict=True)])
        cpu = time.process_time() - cpu0
        if len(engine.scheduler.running) != streams:
            raise RuntimeError("a sequence ended inside the timed ticks")
    median = statistics.median(walls)
    return {"streams": streams, "ticks": ticks, "tick_us": median * 1e6,
            "us_per_seq": median * 1e6 / streams, "cpu_tick_us": cpu / ticks * 1e6,
            "records_per_tick": records / ticks,
            # Each phase's median (Figures.phase_seconds, in ipc.stats.Phase order).
            "phase_us": [statistics.median(p) * 1e6 for p in zip(*phase_ticks, strict=True)]}


def main() -> int:
    # One thread, as the daemon runs a model on a 2-core machine (--threads 0: a core left to
    # the proxy): on shared cores a 2-thread softmax waits milliseconds for its other thread.
    torch.set_num_threads(1)
    for line in sys.stdin:
        ask = json.loads(line)
        print(json.dumps(measure(int(ask["streams"]), int(ask["ticks"]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
