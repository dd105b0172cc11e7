"""IPC benchmark: two processes over real FIFOs.

1. Token records/s, daemon -> proxy, through DaemonPipes.send and ProxyConnection (encode, write,
   read, decode, dispatch), next to a bare anchor: orjson lines over a FIFO, one write per
   record and batched.
2. Control-record latency, ProxyConnection.control -> DaemonPipes.read_control, while the reader
   idles in wait_readable and while it simulates ticks (busy 5 ms, then drains).

    python -m loadtest.bench_ipc [--records N] [--aborts N] [--out results/bench_ipc.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import select
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from ipc.pipes import DaemonPipes, Loss, ProxyConnection, ensure_fifos
from ipc.records import PROTOCOL_VERSION, Abort, AbortCause, Delta, Hello, Welcome
from ipc.stats import Stats
from ipc.wire import ToProxy

FORK = multiprocessing.get_context("fork")
BATCH = 256  # records per DaemonPipes.send, like one tick of a 256-sequence batch
GOAL_RECORDS_PER_S = 500_000
GOAL_IDLE_P99_US = 100.0


def _stats() -> Stats:
    return Stats(time.monotonic(), 0, 0, 0, 0, 0, 0, 0, 0, 0, {}, {}, {})


def _welcome_hellos(pipes: DaemonPipes) -> list[ToProxy]:
    return [Welcome(PROTOCOL_VERSION, os.getpid(), "bench", 2048, r.epoch, r.nonce)
            for r in pipes.read_control() if isinstance(r, Hello)]


def _sets_when_up(up: asyncio.Event) -> Callable[[Loss | None], None]:
    """ProxyConnection's on_state callback: sets `up` once the link to the daemon is up."""

    def on_state(loss: Loss | None) -> None:
        if loss is None:
            up.set()

    return on_state


# -- 1. token records/s ------------------------------------------------------------------------


def _token_daemon(run: Path, total: int, results: multiprocessing.Queue) -> None:
    pipes = DaemonPipes(run)
    while not (out := _welcome_hellos(pipes)):
        pipes.wait_readable(0.1)
    pipes.send(out)
    batch: list[ToProxy] = [Delta(f"cmpl-{i % 64:032x}", i % 4, " tok", [1000 + i])
                            for i in range(BATCH)]
    sent, t0 = 0, time.perf_counter()
    while sent < total:
        pipes.send(batch)
        sent += len(batch)
        while pipes.tokens_backlog > 2 * 1024 * 1024:
            pipes.wait_readable(0.001)  # flushes as the proxy drains
    while pipes.tokens_backlog:
        pipes.wait_readable(0.001)
    results.put(sent / (time.perf_counter() - t0))
    time.sleep(0.5)


async def _token_proxy(run: Path, total: int) -> float:
    done = asyncio.Event()
    up = asyncio.Event()
    count = 0
    t_first = t_last = 0.0

    def on_record(record: ToProxy) -> None:
        nonlocal count, t_first, t_last
        if isinstance(record, Delta):
            count += 1
            if count == 1:
                t_first = time.perf_counter()
            if count == total:
                t_last = time.perf_counter()
                done.set()

    pipes = ProxyConnection(run, on_record, _sets_when_up(up))
    await pipes.start()
    await asyncio.wait_for(up.wait(), 10)
    await asyncio.wait_for(done.wait(), 120)
    await pipes.close()
    return (total - 1) / (t_last - t_first)


def bench_tokens(run: Path, total: int) -> dict[str, float]:
    results: multiprocessing.Queue = FORK.Queue()
    daemon = FORK.Process(target=_token_daemon, args=(run, total, results), daemon=True)
    daemon.start()
    reader_rate = asyncio.run(_token_proxy(run, total))
    writer_rate = results.get(timeout=60)
    daemon.join(5)
    return {"proxy_records_per_s": reader_rate, "daemon_send_records_per_s": writer_rate}


def _bare_writer(path: Path, total: int, batched: bool) -> None:
    """The anchor: dicts -> orjson lines -> FIFO, with no framing layer or records around it."""
    fd = os.open(path, os.O_WRONLY)
    batch = [{"k": "delta", "rid": f"cmpl-{i % 64:032x}", "index": i % 4, "text": " tok",
              "token_ids": [1000 + i]} for i in range(BATCH)]
    dumps = orjson.dumps
    for _ in range(total // BATCH):
        if batched:
            os.write(fd, b"".join([dumps(d) + b"\n" for d in batch]))
        else:
            for d in batch:
                os.write(fd, dumps(d) + b"\n")
    os.close(fd)


def bench_bare(path: Path, total: int, batched: bool) -> float:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    writer = FORK.Process(target=_bare_writer, args=(path, total, batched), daemon=True)
    writer.start()
    # Until the writer opens its end, read() would return EOF at once: wait for its data.
    select.select([fd], [], [], 10)
    os.set_blocking(fd, True)
    count, rest, t0 = 0, b"", None
    while count < total // BATCH * BATCH:
        data = os.read(fd, 1 << 20)
        if not data:
            break
        t0 = t0 or time.perf_counter()
        *lines, rest = (rest + data).split(b"\n")
        for line in lines:
            orjson.loads(line)
        count += len(lines)
    elapsed = time.perf_counter() - (t0 or 0.0)
    os.close(fd)
    writer.join(5)
    return count / elapsed


# -- 2. control latency ------------------------------------------------------------------------


def _control_proxy(run: Path, count: int) -> None:
    async def main() -> None:
        up = asyncio.Event()
        pipes = ProxyConnection(run, lambda r: None, _sets_when_up(up))
        await pipes.start()
        await asyncio.wait_for(up.wait(), 10)
        rng = random.Random(0)
        for phase in ("idle", "tick"):
            for i in range(count):
                await asyncio.sleep(rng.uniform(0.0005, 0.002))
                pipes.control(Abort(f"{phase}-{i}", AbortCause.CLIENT_DISCONNECT, 2,
                                    time.monotonic()))
            await asyncio.sleep(0.05)
            pipes.control(Abort(f"{phase}-end", AbortCause.CANCEL, 2))
        await pipes.close()

    asyncio.run(main())


def bench_control(run: Path, count: int) -> dict[str, dict[str, float]]:
    pipes = DaemonPipes(run)
    proxy = FORK.Process(target=_control_proxy, args=(run, count), daemon=True)
    proxy.start()
    latencies: dict[str, list[float]] = {"idle": [], "tick": []}
    phase, next_stats = "idle", 0.0
    while phase != "done":
        if phase == "idle":
            pipes.wait_readable(0.05)
        else:
            busy_until = time.monotonic() + 0.005  # a forward pass
            while time.monotonic() < busy_until:
                pass
        out: list[ToProxy] = []
        for record in pipes.read_control():
            now = time.monotonic()
            if isinstance(record, Hello):
                out.append(Welcome(PROTOCOL_VERSION, os.getpid(), "bench", 2048, record.epoch,
                                   record.nonce))
            elif isinstance(record, Abort) and record.t_disconnect is not None:
                latencies[phase].append(now - record.t_disconnect)
            elif isinstance(record, Abort) and record.rid.endswith("-end"):
                phase = "tick" if phase == "idle" else "done"
        if time.monotonic() >= next_stats:
            next_stats = time.monotonic() + 0.05
            out.append(_stats())
        pipes.send(out)
    proxy.join(5)
    pipes.close()
    return {name: _percentiles(values) for name, values in latencies.items()}


def _bare_stamp_writer(path: Path, count: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    rng = random.Random(0)
    for _ in range(count):
        time.sleep(rng.uniform(0.0005, 0.002))
        os.write(fd, struct.pack("d", time.monotonic()))
    os.close(fd)


def bench_bare_latency(path: Path, count: int) -> dict[str, float]:
    """The anchor: 8-byte timestamps over a FIFO to a reader asleep in poll(); no Python
    framing, asyncio or records: what this machine's wake-ups cost right now."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    writer = FORK.Process(target=_bare_stamp_writer, args=(path, count), daemon=True)
    writer.start()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    latencies: list[float] = []
    deadline = time.monotonic() + 10 + count * 0.002
    while len(latencies) < count and time.monotonic() < deadline:
        poller.poll(100)
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            continue
        now = time.monotonic()
        latencies += [now - t for (t,) in struct.iter_unpack("d", data)]
    os.close(fd)
    writer.join(5)
    return _percentiles(latencies)


def _percentiles(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100)
    return {"n": len(values), "p50_us": cuts[49] * 1e6, "p99_us": cuts[98] * 1e6,
            "max_us": max(values) * 1e6}


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=400_000, help="token records per run")
    parser.add_argument("--aborts", type=int, default=2000, help="control records per phase")
    parser.add_argument("--out", type=Path, default=Path("results/bench_ipc.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        run = Path(tmp)
        tokens = bench_tokens(run / "tokens", args.records)
        bare_path = ensure_fifos(run / "bare")["tokens"]
        tokens["bare_orjson_one_write_per_s"] = bench_bare(bare_path, args.records, False)
        tokens["bare_orjson_batched_per_s"] = bench_bare(bare_path, args.records, True)
        control = bench_control(run / "control", args.aborts)
        control["bare_fifo"] = bench_bare_latency(ensure_fifos(run / "stamps")["control"],
                                                  args.aborts)

    print(f"token records/s over one FIFO ({args.records} records, {BATCH} per send):")
    print(f"  tether  DaemonPipes.send (encode+write)    {tokens['daemon_send_records_per_s']:>12,.0f}")
    print(f"  tether  ProxyPipes (read+decode+dispatch) {tokens['proxy_records_per_s']:>12,.0f}"
          f"   goal >= {GOAL_RECORDS_PER_S:,}")
    print(f"  bare    orjson lines, one write each      {tokens['bare_orjson_one_write_per_s']:>12,.0f}")
    print(f"  bare    orjson lines, batched writes      {tokens['bare_orjson_batched_per_s']:>12,.0f}")
    print("control latency, ProxyConnection.control -> DaemonPipes.read_control:")
    for name, label in (("idle", "idle in wait_readable"), ("tick", "5 ms ticks, then drain"),
                        ("bare_fifo", "bare FIFO, poll() reader")):
        c = control[name]
        print(f"  {label:<24} p50 {c['p50_us']:>8.1f} us   p99 {c['p99_us']:>8.1f} us   "
              f"max {c['max_us']:>8.1f} us   (n={c['n']})")
    print(f"  goal: idle p99 <= {GOAL_IDLE_P99_US:.0f} us")

    result = {"tokens": tokens, "control_latency": control,
              "goals": {"records_per_s": GOAL_RECORDS_PER_S, "idle_p99_us": GOAL_IDLE_P99_US},
              "met": {"records_per_s": tokens["proxy_records_per_s"] >= GOAL_RECORDS_PER_S,
                      "idle_p99_us": control["idle"]["p99_us"] <= GOAL_IDLE_P99_US}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
