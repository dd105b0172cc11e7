"""What `tether daemon` is told: frozen values, each piece holding what its consumer reads.

The launcher side (tether/) builds these from its settings and validates them there; the daemon
only reads them. `ModelOptions` goes on down into model building, `StoreOptions` to the response
store. No torch here: tether/ imports this module in every process.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class ModelOptions:
    """The model, where it runs, and how its KV cache is sized (the flags of the same names)."""

    model: str
    dtype: str
    device: str
    threads: int
    tensor_parallel_size: int
    kernels: str
    quantization: str
    kv_cache_blocks: int
    kv_cache_mib: int
    gpu_memory_utilization: float
    cuda_graphs: bool
    # The profile pass measures a tick of this shape; the CUDA graphs cover this many sequences.
    max_num_seqs: int
    max_tokens_per_tick: int
    # Ranks 1..N-1's logging, one logging.config.dictConfig dict each (JSON: it travels on
    # their command line); () leaves them Python's defaults.
    rank_log_configs: tuple[dict[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class StoreOptions:
    """The response store: where (a URL, or an SQLite file), what it keeps, who this pair is."""

    location: str | Path
    max_responses: int
    max_age_s: float
    max_bytes: int
    replica_id: str
    lease_s: float
    max_conversations: int = 10_000
    conversation_max_age_s: float = 30 * 24 * 3600.0
    conversation_max_bytes: int = 1 << 30
    conversation_max_items: int = 10_000  # in one conversation


@dataclasses.dataclass(frozen=True, slots=True)
class DaemonOptions:
    model: ModelOptions
    store: StoreOptions
    runtime_dir: Path
    pipe_group: str | None
    prefix_caching: bool
    drain_timeout_s: float
    max_seqs_per_request: int  # prompts x n, checked again here whatever the proxy checked
    grammar_compile_timeout_s: float = 10.0
    grammar_cache_bytes: int = 64 << 20
    tool_call_parser: str = "auto"  # a ToolCallFormat's value, or auto: the chat template's
    served_model_name: str = ""  # the model id clients see; empty: the model's own
    speculative_config: str = ""  # --speculative-config's JSON, checked; empty: off
