"""The tensor-parallel process group: created in one place, torn down in one place.

Rank 0 is the daemon: it keeps the pipes and the tick loop, spawns ranks 1..N-1 (`start`),
watches them, and stops them (`Ranks.close`). A spawned rank `join`s, runs what rank 0 sends,
and `leave`s when told to. Two groups join the same processes:

- the data group (NCCL on CUDA, one GPU per rank; gloo on CPU) carries the forward pass's
  all-reduces and the logits gather. Its timeout is short: within a tick every rank runs the
  same work, so a rank that keeps the others waiting for seconds has hung.
- the control group (gloo, CPU tensors) carries each tick's batch from rank 0. Its timeout is
  long, since a rank waits there for as long as the daemon is idle.

A rank that dies is seen at once: by the watchdog (a pidfd per spawned rank) when idle, by a
collective that fails ("connection closed by peer") mid-tick. Either way rank 0 is told
through `on_lost` and the daemon goes down; the spawned ranks die with rank 0
(PR_SET_PDEATHSIG) or when their group breaks.
"""

from __future__ import annotations

import datetime
import logging
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ipc.processes import describe_exit

log = logging.getLogger("tether.daemon.parallel")

HANG_TIMEOUT_S = 10.0  # a collective of a tick waiting this long means a rank has hung
IDLE_TIMEOUT = datetime.timedelta(days=365)  # the control group: ranks idle with the daemon
JOIN_TIMEOUT_S = 120.0  # for the spawned ranks to import torch and join
STOP_TIMEOUT_S = 5.0  # for the spawned ranks to leave once told to
_END = -1  # a control message of this length: rank 0 is stopping
_FIRST = 2048  # int64s in a control message's first broadcast (a decode tick of 64 sequences
# with 1k-token contexts fits)


class StartError(RuntimeError):
    """The ranks could not be brought up; the message says which and why."""


class TPGroup:
    """One rank's view of the group: its rank, its device and the collectives the model and
    the runner need. `SINGLE` (one rank) makes every collective a no-op."""

    def __init__(self, rank: int, size: int, device: torch.device | None = None,
                 control: dist.ProcessGroup | None = None) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.control = control
        # Time spent in the data collectives. On CUDA, where they are asynchronous, timing
        # them means synchronising at each one, so it is off unless TETHER_TP_TIMING=1 (the
        # benchmarks set it).
        self.timed = (device is None or device.type != "cuda"
                      or os.environ.get("TETHER_TP_TIMING") == "1")
        self.collective_s = 0.0
        self.num_collectives = 0

    def all_reduce(self, x: Tensor) -> Tensor:
        if self.size == 1:
            return x
        t0 = self._clock()
        dist.all_reduce(x)
        self._count(t0)
        return x

    def gather_columns(self, x: Tensor) -> Tensor:
        """Rank 0 gets every rank's columns side by side; the others keep their own."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        t0 = self._clock()
        dist.gather(x, parts, dst=0)
        self._count(t0)
        return torch.cat(parts, dim=1) if parts is not None else x

    # --- control plane: rank 0 -> every rank ---------------------------------------------------

    def send(self, message: Tensor | None) -> None:
        """Rank 0: broadcast a 1-D int64 CPU tensor; None tells the others to leave. A batch
        fits in the first broadcast (its length first) unless it is large: one round trip."""
        n = _END if message is None else message.numel()
        first = torch.zeros(_FIRST, dtype=torch.long)
        first[0] = n
        if message is not None:
            first[1 : 1 + min(n, _FIRST - 1)] = message[: _FIRST - 1]
        dist.broadcast(first, 0, group=self.control)
        if message is not None and n > _FIRST - 1:
            dist.broadcast(message[_FIRST - 1 :].contiguous(), 0, group=self.control)

    def receive(self) -> Tensor | None:
        """The other ranks: the next message from rank 0, or None when it is stopping."""
        first = torch.empty(_FIRST, dtype=torch.long)
        dist.broadcast(first, 0, group=self.control)
        n = int(first[0])
        if n == _END:
            return None
        if n <= _FIRST - 1:
            return first[1 : 1 + n]
        rest = torch.empty(n - (_FIRST - 1), dtype=torch.long)
        dist.broadcast(rest, 0, group=self.control)
        return torch.cat([first[1:], rest])

    def gather_object(self, obj: object) -> list[object] | None:
        out: list[object] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def _clock(self) -> float:
        if not self.timed:
            return 0.0
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _count(self, t0: float) -> None:
        self.collective_s += self._clock() - t0
        self.num_collectives += 1


SINGLE = TPGroup(0, 1)


def device_for(rank: int, device_type: str) -> torch.device:
    """One GPU per rank, in CUDA_VISIBLE_DEVICES order; every rank on the CPU otherwise."""
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def threads_per_rank(threads: int, size: int) -> int:
    """--threads (0: one per core, less one left to the proxy) shared out between the ranks."""
    total = threads or max(1, (os.cpu_count() or 1) - 1)
    return max(1, total // size)


def _init(rank: int, size: int, device_type: str, store: dist.Store) -> TPGroup:
    # Every rank is on this machine: keep gloo's and NCCL's sockets on loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    device = device_for(rank, device_type)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    # device_id: NCCL's communicator is made now, not by the first all-reduce of a tick.
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=HANG_TIMEOUT_S),
                            device_id=device if cuda else None)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(rank, size, device, control)


def join(rank: int, size: int, port: int, device_type: str) -> TPGroup:
    """A spawned rank joins rank 0's group (the store listens on 127.0.0.1:port)."""
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False,
                          timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    store.set(f"joined/{rank}", str(os.getpid()))
    return _init(rank, size, device_type, store)


def leave() -> None:
    """A spawned rank's teardown."""
    if dist.is_initialized():
        dist.destroy_process_group()


Spawn = Callable[[int, int], subprocess.Popen[bytes]]  # (rank, store port) -> its process


def start(size: int, device_type: str, spawn: Spawn) -> Ranks:
    """Rank 0: spawn ranks 1..size-1 and form the group with them. Raises StartError."""
    if device_type == "cuda" and torch.cuda.device_count() < size:
        raise StartError(f"--tensor-parallel-size {size} needs {size} GPUs, "
                         f"{torch.cuda.device_count()} visible (CUDA_VISIBLE_DEVICES picks them)")
    try:
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    except RuntimeError as e:
        raise StartError(f"the ranks meet on a loopback TCP port, which failed: {e} (under "
                         "systemd the daemon's unit must allow AF_INET: see docs/models.md)") from e
    ranks = Ranks([spawn(rank, store.port) for rank in range(1, size)])
    try:
        ranks.await_joins(store)
        ranks.group = _init(0, size, device_type, store)
    except Exception as e:
        ranks.close()
        if isinstance(e, StartError):
            raise
        raise StartError(f"forming the tensor-parallel group failed: {e}") from e
    except BaseException:
        ranks.close()
        raise
    return ranks


class Ranks:
    """Rank 0's handle on the spawned ranks: their processes, the group, the watchdog."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self.group: TPGroup = SINGLE
        self.failure: str | None = None
        self._on_lost: Callable[[str], None] | None = None
        self._closing = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._watchdog: threading.Thread | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def await_joins(self, store: dist.Store) -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        waiting = dict(enumerate(self.procs, start=1))
        while waiting:
            for rank, proc in list(waiting.items()):
                if proc.poll() is not None:
                    raise StartError(f"tensor-parallel rank {rank} (pid {proc.pid}) "
                                     f"{describe_exit(proc.returncode)} before joining")
                if store.check([f"joined/{rank}"]):
                    del waiting[rank]
            if time.monotonic() > deadline:
                raise StartError(f"tensor-parallel ranks {sorted(waiting)} did not join within "
                                 f"{JOIN_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def exited(self, wait_s: float = 0.0) -> str | None:
        """Which spawned rank has exited and how, waiting up to `wait_s` for one to (a broken
        collective can be seen a moment before the exit that broke it)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    return f"tensor-parallel rank {rank} (pid {proc.pid}) " \
                           f"{describe_exit(proc.returncode)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """From now on a spawned rank that exits calls `on_lost(reason)` (once, from a thread)."""
        self._on_lost = on_lost
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    def lost(self, reason: str) -> None:
        """A rank is gone or the group broke: the first reason is kept and reported."""
        if self.failure is not None or self._closing:
            return
        self.failure = reason
        log.error("%s", reason)
        if self._on_lost is not None:
            self._on_lost(reason)

    def _watch(self) -> None:
        pidfds = {os.pidfd_open(p.pid): (rank, p) for rank, p in enumerate(self.procs, start=1)}
        try:
            ready, _, _ = select.select([*pidfds, self._wake_r], [], [])
            for fd in ready:
                if fd in pidfds:
                    rank, proc = pidfds[fd]
                    proc.wait()
                    self.lost(f"tensor-parallel rank {rank} (pid {proc.pid}) "
                              f"{describe_exit(proc.returncode)}")
                    break
        finally:
            for fd in pidfds:
                os.close(fd)

    def close(self) -> None:
        """Tell the spawned ranks to leave, wait for them (killing any that linger), and
        destroy the group. Safe to call after a failure: a broken group is not spoken to."""
        self._closing = True
        os.write(self._wake_w, b"x")
        if self.group.size > 1 and self.failure is None:
            try:
                self.group.send(None)
            except Exception as e:  # a rank died while we were stopping
                log.warning("telling the tensor-parallel ranks to stop failed: %s", e)
                self.failure = str(e)
        # After a failure the others hold nothing worth waiting for: they are killed at once.
        deadline = time.monotonic() + (STOP_TIMEOUT_S if self.failure is None else 0.0)
        for rank, proc in enumerate(self.procs, start=1):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                log.info("tensor-parallel rank %d (pid %d) %s", rank, proc.pid,
                         describe_exit(proc.returncode))
            except subprocess.TimeoutExpired:
                if self.failure is None:
                    log.warning("tensor-parallel rank %d did not stop in time; killing it", rank)
                else:
                    log.info("tensor-parallel rank %d (pid %d) killed: the group has failed",
                             rank, proc.pid)
                proc.kill()
                proc.wait()
        if self._watchdog is not None:
            self._watchdog.join()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if dist.is_initialized():
            dist.destroy_process_group()
