"""The CUDA path on one GPU, in one run under a wall budget: correctness, speed, memory, aborts,
host cost, structured outputs.

    python tests/gpu/gpu_check.py --out DIR [--budget-s 330]   # on the GPU (tests/gpu/run.sh)
    python tests/gpu/gpu_check.py --out DIR --dry-run          # the same script on the CPU

Sections, in priority order; each runs in its own try block and writes DIR/<section>.json as
soon as it ends, so a failure or the budget running out never loses the others:
  a_correctness  bf16 greedy tokens of our engine (CUDA graphs on, chunked prefill, n > 1,
                 preemption) against transformers on the same GPU, for a random Llama of the
                 ~1B shape and for builtin:small; where a token differs, HF's logit gap
  b_speed        decode tokens/s at 1, 32 and 128 streams and on a 64-request mix (timed after
                 one untimed pass of it), ours (in this process, graphs on and off) against
                 transformers generate
  c_memory       a real `tether serve` sized by --gpu-memory-utilization, 256 streams at once
  d_abort        python -m loadtest.bench_abort over real processes, shortened
  e_host         host cost per sequence per tick at 128 and 256 streams (loadtest/host_ticks.py):
                 sim:0 on this machine's CPU, and the 1B on the daemon's runner, its forward
                 passes timed apart
  f_guided       a real `tether serve` of the 1B: random JSON schemas (the share of valid
                 outputs), constrained against unconstrained tokens/s at 64 streams
                 (loadtest/bench_structured.py's loops; goal: <= 10% slower), one forced tool call
summary.json and a table at the end. A section is skipped, with a note, when the time left is
under its estimate. --dry-run runs every section on the CPU with builtin:tiny and toy sizes
(tests/gpu/test_gpu_check.py runs it, so the script cannot rot unseen).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import logging
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
for extra in (REPO, Path(__file__).resolve().parent):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import gpu_case  # noqa: E402
import gpu_engine  # noqa: E402
import gpu_host  # noqa: E402
import gpu_serve  # noqa: E402
import torch  # noqa: E402
from gpu_case import Case  # noqa: E402


class Budget:
    """Wall seconds left of the run; T0 may come from run.sh (the clock starts after the wheel
    install)."""

    def __init__(self, seconds: float) -> None:
        self.t0 = float(os.environ.get("GPU_CHECK_T0") or time.time())
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.time() - self.t0)


SECTIONS: list[tuple[str, float, Callable[[Case, Budget], dict[str, Any]]]] = [
    # name, estimated seconds on the GPU, function
    ("a_correctness", 45, lambda case, budget: gpu_engine.correctness(case, budget.left)),
    ("b_speed", 65, lambda case, budget: gpu_engine.speed(case, budget.left)),
    ("c_memory", 40, lambda case, budget: gpu_serve.memory(case, budget.left)),
    ("d_abort", 45, lambda case, budget: gpu_serve.abort(case, budget.left)),
    ("e_host", 35, lambda case, budget: gpu_host.host(case, budget.left)),
    ("f_guided", 60, lambda case, budget: gpu_serve.guided(case, budget.left)),
]


def run_section(name: str, estimate: float, fn: Callable[[Case, Budget], dict[str, Any]],
                case: Case, budget: Budget, out: Path) -> dict[str, Any]:
    record: dict[str, Any] = {"section": name, "estimate_s": estimate}
    left = budget.left()
    if left < estimate * case.estimate_scale:
        record.update(status="skipped",
                      note=f"{left:.0f} s of the budget left, the section needs ~{estimate} s")
    else:
        t0 = time.time()
        print(f"== {name} ({left:.0f} s left)", flush=True)
        # A section stuck past twice its estimate prints every thread's stack to the log.
        faulthandler.dump_traceback_later(2 * estimate * case.estimate_scale, repeat=True)
        try:
            result = fn(case, budget)
            record.update(status="ok" if result.pop("passed", True) else "fail", result=result)
        except Exception as e:
            record.update(status="error", error=f"{type(e).__name__}: {e}",
                          traceback=traceback.format_exc())
            print(record["traceback"], flush=True)
        finally:
            faulthandler.cancel_dump_traceback_later()
        record["seconds"] = round(time.time() - t0, 1)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    (out / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
    print(f"== {name}: {record['status']} {record.get('seconds', '')}", flush=True)
    return record


def environment(case: Case) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "device": case.device, "dtype": str(case.dtype)}
    for name in ("transformers", "triton"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    if case.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    return info


def table(records: list[dict[str, Any]]) -> str:
    lines = [f"{'section':<14} {'status':<8} {'s':>6}  headline"]
    for r in records:
        headline = (r.get("result") or {}).get("headline") or r.get("note") or r.get("error", "")
        lines.append(f"{r['section']:<14} {r['status']:<8} {r.get('seconds', ''):>6}  {headline}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=330.0)
    parser.add_argument("--dry-run", action="store_true",
                        help="the CPU, builtin:tiny and toy sizes: proves the script runs")
    parser.add_argument("--only", default="", help="comma-separated section names")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    budget = Budget(args.budget_s)
    case = gpu_case.dry_run_case() if args.dry_run else gpu_case.gpu_case()
    if case.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run on a CPU)", flush=True)
        return 2
    only = {s for s in args.only.split(",") if s}
    summary: dict[str, Any] = {"environment": environment(case), "budget_s": args.budget_s}
    print(json.dumps(summary["environment"]), flush=True)
    records = [run_section(name, estimate, fn, case, budget, args.out)
               for name, estimate, fn in SECTIONS if not only or name in only]
    summary["sections"] = {r["section"]: r["status"] for r in records}
    summary["seconds"] = round(time.time() - budget.t0, 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\n" + table(records), flush=True)
    print(f"total {summary['seconds']} s of {args.budget_s:.0f}", flush=True)
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
