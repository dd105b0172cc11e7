"""Tensor parallelism on GPUs: NCCL, one GPU per rank (CUDA_VISIBLE_DEVICES picks them).

    python tests/gpu/tp_check.py [--tensor-parallel-size 2] [--skip-bench]

1. parity: tests/daemon/model/parallel/test_runner.py on CUDA: TP=N logits within 1e-4 of one GPU
   (float32) and greedy tokens identical, for builtin:tiny and an HF checkpoint made on the
   spot, with chunked prefill, preemption, n > 1 and an abort mid-decode;
2. benchmark: python -m loadtest.bench_tp --device cuda --dtype bfloat16: tokens/s at TP=1 and TP=N
   and the time per tick in the NCCL collectives (synchronised to be timed).

For a machine with several GPUs; not part of the suite (CI has none). Exits non-zero when a
step fails, 2 when there are too few GPUs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args()
    import torch

    size, gpus = args.tensor_parallel_size, torch.cuda.device_count()
    if gpus < size:
        print(f"tp_check: --tensor-parallel-size {size} needs {size} GPUs, {gpus} visible")
        return 2
    env = dict(os.environ, TETHER_TP_TEST_DEVICE="cuda", TETHER_TP_TEST_SIZE=str(size),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                          if p))
    steps = [[sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
              "tests/daemon/model/parallel/test_runner.py"]]
    if not args.skip_bench:
        steps.append([sys.executable, "-m", "loadtest.bench_tp", "--tensor-parallel-size",
                      str(size), "--device", "cuda", "--dtype", "bfloat16", "--threads", "4"])
    for argv in steps:
        print("tp_check:", " ".join(argv[1:]), flush=True)
        if subprocess.run(argv, cwd=REPO, env=env).returncode:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
