"""The benchmark's relay: what it forwards arrives whole and in order, a delay later each way."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from loadtest.bench_store_latency import _relay
from loadtest.pair import free_port


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _round_trip(socket_path: str, port: int) -> tuple[bytes, float]:
    echo = await asyncio.start_unix_server(_echo, socket_path)
    relay = asyncio.create_task(_relay(port, socket_path, 0.05))
    for _ in range(100):  # until the relay listens
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            break
        except OSError:
            await asyncio.sleep(0.01)
    sent = b"".join(f"{i:06d}".encode() for i in range(20_000))
    started = time.monotonic()
    writer.write(sent)
    await writer.drain()
    got = await reader.readexactly(len(sent))
    elapsed = time.monotonic() - started
    writer.close()
    relay.cancel()
    echo.close()
    return got, elapsed


def test_the_relay_delays_each_way_and_keeps_the_bytes_in_order(tmp_path: Path) -> None:
    sent = b"".join(f"{i:06d}".encode() for i in range(20_000))
    got, elapsed = asyncio.run(_round_trip(str(tmp_path / "echo.sock"), free_port()))
    assert got == sent
    assert elapsed >= 0.1  # 50 ms there, 50 ms back
