"""What a remote Responses store costs a chat stream that never touches it: a real PostgreSQL
behind a TCP relay that holds every chunk ``--delay-ms`` each way (a database across a network),
tether on ``--state-url`` through the relay, and ``--clients`` clients making short stored
Responses turns beside one streaming chat client.

    python -m loadtest.bench_store_latency [--delay-ms 5] [--clients 16] [--seconds 20]
        [--model sim:20] [--repo PATH] [--out DIR]

First the bystander streams alone (``--quiet-s``): its median gap between events is the quiet
figure. Then the clients make turns for ``--seconds``, each continuing its previous response
(``previous_response_id``; a new chain every ``--chain`` turns, so histories stay short): the
bystander's gaps (median, p95, longest) and the turns' throughput and latency. The issue's goal
(36): p95 under 2x the quiet median, the longest gap under 150 ms, and no fewer turns a second
than before. ``--repo`` serves another checkout (main, to compare); PostgreSQL comes from
tests/support/postgres.py (initdb and pg_ctl on PATH or under /usr/lib/postgresql). Writes
bench_store_latency.json under results/store-latency-<timestamp>/ (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import quote

from loadtest.pair import REPO, ServerPair, free_port
from loadtest.report import percentile, results_dir, summary, write_json
from tests.support.postgres import Postgres, pg_bin_dir
from tests.support.streams import Paced

SPAWN = multiprocessing.get_context("spawn")


# --- the relay: PostgreSQL's Unix socket, a TCP port, and a delay each way -------------------


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                delay_s: float) -> None:
    """Copies ``reader`` to ``writer``, each chunk ``delay_s`` after it arrived, in order: the
    latency of a link, not a limit on its throughput."""
    due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        loop = asyncio.get_running_loop()
        while True:
            at, data = await due.get()
            if not data:
                break
            await asyncio.sleep(max(0.0, at - loop.time()))
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(send())
    loop = asyncio.get_running_loop()
    try:
        while data := await reader.read(1 << 16):
            due.put_nowait((loop.time() + delay_s, data))
    finally:
        due.put_nowait((0.0, b""))
        await sender


async def _relay(port: int, socket_path: str, delay_s: float) -> None:
    async def connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_unix_connection(socket_path)
        await asyncio.gather(_pump(reader, up_writer, delay_s),
                             _pump(up_reader, writer, delay_s), return_exceptions=True)

    server = await asyncio.start_server(connect, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def run_relay(port: int, socket_path: str, delay_s: float) -> None:
    asyncio.run(_relay(port, socket_path, delay_s))


# --- the clients: stored turns, each continuing the one before ------------------------------


async def _client(url: str, until: float, chain: int, out: list[tuple[float, int]]) -> None:
    import httpx

    previous: str | None = None
    turns = 0
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as c:
        while time.monotonic() < until:
            body: dict[str, Any] = {"input": f"turn {turns}: say something", "max_output_tokens": 8}
            if previous is not None:
                body["previous_response_id"] = previous
            started = time.monotonic()
            r = await c.post("/v1/responses", json=body)
            out.append((time.monotonic() - started, r.status_code))
            turns += 1
            previous = r.json()["id"] if r.status_code == 200 and turns % chain else None


def run_clients(url: str, clients: int, seconds: float, chain: int, conn: Connection) -> None:
    out: list[tuple[float, int]] = []

    async def main() -> None:
        until = time.monotonic() + seconds
        await asyncio.gather(*(_client(url, until, chain, out) for _ in range(clients)))

    asyncio.run(main())
    conn.send(out)
    conn.close()


# --- one measurement ------------------------------------------------------------------------


def _gaps(stream: Paced, start: float, end: float) -> list[float]:
    times = [t for t in stream.arrivals if start <= t <= end]
    return [b - a for a, b in itertools.pairwise(times)]


def _figures(gaps: list[float]) -> dict[str, Any]:
    return {"p50_s": statistics.median(gaps) if gaps else None,
            "p95_s": percentile(gaps, 0.95), "max_s": max(gaps) if gaps else None,
            "n": len(gaps)}


def measure(args: argparse.Namespace, state_url: str) -> dict[str, Any]:
    pair = ServerPair(args.model, extra_args=["--state-url", state_url], repo=args.repo).start()
    try:
        stream = Paced(pair.base_url).start()
        quiet_start = time.monotonic()
        time.sleep(args.quiet_s)
        quiet = _gaps(stream, quiet_start, time.monotonic())
        ours, theirs = SPAWN.Pipe(duplex=False)
        clients = SPAWN.Process(target=run_clients, args=(
            pair.base_url, args.clients, args.seconds, args.chain, theirs), daemon=True)
        load_start = time.monotonic()
        clients.start()
        turns: list[tuple[float, int]] = ours.recv()
        load_end = time.monotonic()
        clients.join(30)
        loaded = _gaps(stream, load_start, load_end)
        stream.stop()
    finally:
        pair.stop()
    ok = [t for t, status in turns if status == 200]
    result = {"quiet": _figures(quiet), "load": _figures(loaded),
              "turns": {"ok": len(ok), "failed": len(turns) - len(ok),
                        "per_s": len(ok) / (load_end - load_start),
                        "latency_s": summary(ok)}}
    median = result["quiet"]["p50_s"]
    result["goal"] = {"p95_under_2x_quiet_median": (result["load"]["p95_s"] or 0) < 2 * median,
                      "max_under_150ms": (result["load"]["max_s"] or 0) < 0.150}
    return result


def _print(label: str, r: dict[str, Any]) -> None:
    q, ld, t = r["quiet"], r["load"], r["turns"]
    print(f"{label}: quiet median {q['p50_s'] * 1e3:.1f} ms | under load median "
          f"{ld['p50_s'] * 1e3:.1f} ms, p95 {ld['p95_s'] * 1e3:.1f} ms, max "
          f"{ld['max_s'] * 1e3:.1f} ms | stored turns {t['per_s']:.1f}/s ({t['ok']} ok, "
          f"{t['failed']} failed, latency p50 {t['latency_s']['p50'] * 1e3:.0f} ms) | goal "
          f"{r['goal']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, default=5.0, help="each way")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--quiet-s", type=float, default=5.0)
    parser.add_argument("--chain", type=int, default=4, help="turns a chain before a new one")
    parser.add_argument("--model", default="sim:20")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--repo", type=Path, default=REPO,
                        help="the checkout to serve (another tree, to compare)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    bin_dir = pg_bin_dir()
    if bin_dir is None:
        print("bench_store_latency: PostgreSQL is not installed (initdb, pg_ctl); skipped")
        return 0
    out = results_dir(args.out, "store-latency")
    postgres = Postgres(bin_dir, port=free_port())
    postgres.start()
    relay_port = free_port()
    relay = SPAWN.Process(target=run_relay, daemon=True, args=(
        relay_port, str(postgres.dir / f".s.PGSQL.{postgres.port}"), args.delay_ms / 1e3))
    relay.start()
    results: dict[str, Any] = {"delay_ms_each_way": args.delay_ms, "clients": args.clients,
                               "model": args.model, "repo": str(args.repo), "runs": []}
    try:
        for i in range(args.repeat):
            url = postgres.new_schema()
            schema = url.rsplit("search_path%3D", 1)[1]
            state_url = (f"postgresql://postgres@127.0.0.1:{relay_port}/postgres?options="
                         + quote(f"-csearch_path={schema}"))
            run = measure(args, state_url)
            results["runs"].append(run)
            _print(f"run {i + 1}", run)
    finally:
        relay.terminate()
        postgres.stop()
    print(write_json(out / "bench_store_latency.json", results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
