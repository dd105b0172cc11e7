"""Settings turned into what each process is told: `daemon_options` and `proxy_options`.

The one place that knows both the settings and the option objects of daemon/ and proxy/, so
neither package imports tether/. Each function imports its package's options when called:
`tether proxy` never imports daemon/, `tether daemon` never proxy/. Defaults that depend on
more than one setting (the replica id, the store's location) are resolved here, once.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

import tether
from tether import logs
from tether.settings import Settings

if TYPE_CHECKING:
    from daemon.options import DaemonOptions
    from proxy.options import ProxyOptions


def daemon_options(s: Settings) -> DaemonOptions:
    from daemon.options import DaemonOptions, ModelOptions, StoreOptions

    model = ModelOptions(
        model=s.model, dtype=s.dtype, device=s.device, threads=s.threads,
        tensor_parallel_size=s.tensor_parallel_size, kernels=s.kernels,
        quantization=s.quantization, kv_cache_blocks=s.kv_cache_blocks,
        kv_cache_mib=s.kv_cache_mib, gpu_memory_utilization=s.gpu_memory_utilization,
        cuda_graphs=s.cuda_graphs, max_num_seqs=s.max_num_seqs,
        max_tokens_per_tick=s.max_tokens_per_tick,
        rank_log_configs=tuple(logs.config(s.log_format, s.log_level, f"daemon rank {rank}")
                               for rank in range(1, s.tensor_parallel_size)))
    store = StoreOptions(
        location=s.state_url or s.state_dir / "responses.sqlite3",
        max_responses=s.response_store_max, max_age_s=s.response_store_max_age_s,
        max_bytes=s.response_store_max_bytes,
        max_conversations=s.conversation_store_max,
        conversation_max_age_s=s.conversation_store_max_age_s,
        conversation_max_bytes=s.conversation_store_max_bytes,
        conversation_max_items=s.conversation_max_items,
        # --replica-id, or host:port: unique per pair, and the same across its restarts.
        replica_id=s.replica_id or f"{socket.gethostname()}:{s.port}",
        lease_s=s.replica_lease_s)
    return DaemonOptions(
        model=model, store=store, runtime_dir=s.runtime_dir, pipe_group=s.pipe_group,
        prefix_caching=s.prefix_caching, drain_timeout_s=s.drain_timeout_s,
        grammar_compile_timeout_s=s.grammar_compile_timeout_s,
        grammar_cache_bytes=s.grammar_cache_mib << 20,
        tool_call_parser=s.tool_call_parser,
        max_seqs_per_request=s.max_seqs_per_request, served_model_name=s.served_model_name,
        speculative_config=s.speculative_config)


def proxy_options(s: Settings) -> ProxyOptions:
    from proxy.options import CorsOptions, ProxyOptions

    return ProxyOptions(
        host=s.host, port=s.port, keep_alive_timeout_s=s.keep_alive_timeout_s,
        drain_timeout_s=s.drain_timeout_s, max_connections=s.max_connections,
        max_header_bytes=s.max_header_bytes, header_timeout_s=s.header_timeout_s,
        body_timeout_s=s.body_timeout_s, body_min_rate=s.body_min_rate, api_keys=tuple(s.api_key),
        api_key_everywhere=s.api_key_scope == "all", max_body_bytes=s.max_body_bytes,
        max_seqs_per_request=s.max_seqs_per_request,
        max_collected_bytes=s.max_collected_bytes, model=s.served_model_name or s.model,
        runtime_dir=s.runtime_dir,
        max_waiting=s.max_waiting, request_timeout_s=s.request_timeout_s,
        stall_timeout_s=s.stall_timeout_s, max_buffered_tokens=s.max_buffered_tokens,
        stream_merge_tokens=s.stream_merge_tokens,
        background_history_bytes=s.background_history_bytes,
        cors=CorsOptions(tuple(s.allowed_origins), tuple(s.allowed_methods),
                         tuple(s.allowed_headers)),
        access_log_sample=s.access_log_sample, version=tether.__version__)
