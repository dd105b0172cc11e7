"""What `tether proxy` is told: frozen values, built and validated by tether/ from its settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True, slots=True)
class CorsOptions:
    """Who may call the API from a browser (the --allowed-* flags); no origins: CORS is off."""

    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = ("GET", "POST", "DELETE", "OPTIONS")
    headers: tuple[str, ...] = ("Authorization", "Content-Type", "X-Request-Id")


@dataclasses.dataclass(frozen=True, slots=True)
class ProxyOptions:
    # The server: where it listens, how long it keeps idle connections and drains on SIGTERM.
    host: str
    port: int
    keep_alive_timeout_s: int
    drain_timeout_s: float
    # What one connection may hold of it (proxy/http/protocol.py): the server's share of
    # connections, a request head's bytes and time, a body's time and rate.
    max_connections: int
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    body_min_rate: int
    # The app: who may call it, what it accepts, the name it answers to before the daemon says.
    api_keys: tuple[str, ...]
    max_body_bytes: int
    max_seqs_per_request: int
    max_collected_bytes: int  # what one request that does not stream may make the proxy hold
    model: str
    # The engine client: the pipes, and the limits and flow control of the sessions on them.
    runtime_dir: Path
    max_waiting: int
    request_timeout_s: float
    stall_timeout_s: float
    max_buffered_tokens: int
    stream_merge_tokens: int
    # Background responses: the bytes of events kept for their readers, all runs together.
    background_history_bytes: int
    # Browsers and the access log (the share of successful requests written).
    cors: CorsOptions = CorsOptions()
    access_log_sample: float = 1.0
    # The key guards every route, /health, /metrics and /openapi.json too (--api-key-scope all).
    api_key_everywhere: bool = False
    version: str = ""  # tether's, shown by /health
