"""Ranks 1..N-1: spawned by rank 0 as `python -m daemon.model.parallel.rank SPEC`, each joins
the group, loads its shard of the model, and runs what rank 0 sends until told to leave.

The spec (JSON on the command line) is written by `spawner` and read by `main`, both here.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import torch

from daemon.model.loader import load_model, pick_device
from daemon.model.parallel import group as parallel
from daemon.model.parallel.codec import REPORT, RUN, RankFigures, decode_run
from daemon.model.parallel.group import TPGroup
from daemon.model.runner import ModelRunner
from daemon.options import ModelOptions
from ipc.processes import die_with_parent

log = logging.getLogger("tether.daemon")


def spawner(options: ModelOptions) -> parallel.Spawn:
    # The spawned ranks are not systemd's business (NotifyAccess=main) and hold no FIFO.
    env = {k: v for k, v in os.environ.items()
           if k != "NOTIFY_SOCKET" and not k.startswith(("WATCHDOG_", "LISTEN_"))}

    def spawn(rank: int, port: int) -> subprocess.Popen[bytes]:
        log_configs = options.rank_log_configs
        spec = {"rank": rank, "size": options.tensor_parallel_size, "port": port,
                "parent": os.getpid(), "model": options.model, "device": options.device,
                "dtype": options.dtype, "kernels": options.kernels,
                "threads": torch.get_num_threads(),
                "log_config": log_configs[rank - 1] if log_configs else None}
        return subprocess.Popen([sys.executable, "-m", "daemon.model.parallel.rank",
                                 json.dumps(spec)], env=env, stdin=subprocess.DEVNULL)

    return spawn


def serve(group: TPGroup, runner: ModelRunner) -> None:
    """Run what rank 0 sends until it says stop."""
    figures = RankFigures(group.rank)
    while (message := group.receive()) is not None:
        op = int(message[0])
        if op == RUN:
            chunks, copies = decode_run(message)
            for src, dst in copies:
                runner.copy_block(src, dst)
            runner.run(chunks)
            figures.ran(chunks, group)
        elif op == REPORT:
            group.gather_object(figures)


def _follow_parent(parent: int) -> None:
    # Die with rank 0 even when it is SIGKILLed; SIGTERM and Ctrl-C are rank 0's to handle
    # (it drains, then tells this rank to leave).
    die_with_parent(parent, signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: Sequence[str] | None = None) -> int:
    spec: dict[str, Any] = json.loads((argv or sys.argv[1:])[0])
    rank = spec["rank"]
    _follow_parent(spec["parent"])
    if spec["log_config"] is not None:
        logging.config.dictConfig(spec["log_config"])
    torch.set_num_threads(spec["threads"])
    device = pick_device(spec["device"])
    try:
        group = parallel.join(rank, spec["size"], spec["port"], device.type)
    except Exception as e:
        log.error("rank %d cannot join rank 0: %s", rank, e)
        return 1
    try:
        loaded = load_model(spec["model"], group.device or device, spec["dtype"], group=group,
                            kernels=spec["kernels"])
        init = group.receive()
        if init is None:
            return 0
        runner = ModelRunner(loaded.model, loaded.config, int(init[1]))
        group.gather_object(None)
        serve(group, runner)
    except Exception as e:
        log.error("rank %d stops: %s: %s", rank, type(e).__name__, e)
        return 1
    finally:
        parallel.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
