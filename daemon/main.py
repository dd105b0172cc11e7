"""`tether daemon`: load the model, open the store and the pipes, serve until SIGTERM."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import msgspec

from daemon.engine.core import Engine, Runner
from daemon.engine.grammar import Grammars
from daemon.engine.guided import Guidance
from daemon.engine.speculative import parse_config
from daemon.model.chat_template import TOOL_CALL_TOKENS, tool_call_format
from daemon.model.tokenizer import Tokenizer
from daemon.options import DaemonOptions, ModelOptions
from daemon.prompts import single_tool_call
from daemon.responses.conversations import ConversationLimits
from daemon.responses.store import ResponseStore, StoreError
from daemon.server import DaemonServer, Notify
from ipc.pipes import DaemonPipes, EpochCounter, PipeError, inherited_fifos
from ipc.records import GenerationDefaults, ToolCallFormat

if TYPE_CHECKING:
    from daemon.model.parallel.group import Ranks

log = logging.getLogger("tether.daemon")


def run(options: DaemonOptions, notify: Notify | None = None) -> int:
    """Entry point of `tether daemon`; returns the process exit code."""
    t0 = time.monotonic()
    try:
        built, ranks = _build_runner(options.model)
    except ValueError as e:
        log.error("cannot load model %s: %s", options.model.model, e)
        return 1
    try:
        return _serve(options, built, ranks, notify, t0)
    finally:
        if ranks is not None:
            ranks.close()


def _serve(options: DaemonOptions, built: Built, ranks: Ranks | None, notify: Notify | None,
           t0: float) -> int:
    runner, tokenizer, name, max_model_len, defaults = built
    name = options.served_model_name or name
    o = options.store
    try:
        limits = ConversationLimits(o.max_conversations, o.conversation_max_age_s,
                                    o.conversation_max_bytes, o.conversation_max_items)
        store = ResponseStore(o.location, o.max_responses, o.max_age_s, max_bytes=o.max_bytes,
                              replica_id=o.replica_id, lease_s=o.lease_s, conversations=limits)
    except (StoreError, ValueError) as e:
        log.error("%s", e)
        return 1
    try:
        pipes = DaemonPipes(options.runtime_dir, options.pipe_group, inherited_fifos())
    except (PipeError, ValueError) as e:
        log.error("%s", e)
        store.close()
        return 1
    crashed = store.cleanup_crashed()
    if crashed:
        log.warning("ended %d responses left unfinished by a previous run", crashed)
    store.start_watching()
    try:
        grammars = Grammars(tokenizer, tokenizer.special_token_ids,
                            cache_bytes=options.grammar_cache_bytes)
        engine = Engine(runner, tokenizer, store, options.model.max_num_seqs,
                        options.model.max_tokens_per_tick, max_model_len, name,
                        prefix_caching=options.prefix_caching,
                        guidance=Guidance(grammars, options.grammar_compile_timeout_s),
                        max_seqs_per_request=options.max_seqs_per_request,
                        speculative=parse_config(options.speculative_config))
    except ValueError as e:
        log.error("%s", e)
        pipes.close()
        store.close()
        return 1
    size = options.model.tensor_parallel_size
    log.info("model %s loaded in %.1f s; %d KV blocks of %d tokens%s; prefix caching %s; "
             "pipes in %s", name, time.monotonic() - t0, runner.num_blocks, runner.block_size,
             f" on each of {size} tensor-parallel ranks" if size > 1 else "",
             "on" if options.prefix_caching else "off", options.runtime_dir)
    epoch_file = options.runtime_dir / "epoch" if options.runtime_dir.is_dir() else None
    server = DaemonServer(engine, pipes, store, options.drain_timeout_s, notify,
                          epochs=EpochCounter(epoch_file), tensor_parallel_size=size,
                          tool_call_format=_tool_call_format(options.tool_call_parser,
                                                             tokenizer),
                          single_tool_call=_single_tool_call(tokenizer),
                          generation_defaults=defaults)
    if ranks is not None:
        ranks.watch(server.fail)
    previous = _install_signals(server)
    try:
        return server.serve()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        pipes.close()
        store.close()


def _tool_call_format(parser: str, tokenizer: Tokenizer) -> ToolCallFormat:
    """--tool-call-parser, or the format the chat template teaches (Hermes' when it names
    none, as tether's own template does); its special tokens decode as the text it is parsed
    from."""
    found = tool_call_format(tokenizer.chat_template)
    name = parser if parser != "auto" else found or ToolCallFormat.HERMES.value
    log.info("tool calls in the %s format (%s)", name, "--tool-call-parser" if parser != "auto"
             else "the chat template's" if found else "no format in the chat template")
    tokenizer.show_in_text(TOOL_CALL_TOKENS.get(name, ()))
    return ToolCallFormat(name)


def _single_tool_call(tokenizer: Tokenizer) -> bool:
    single = single_tool_call(tokenizer)
    if single:
        log.info("the chat template takes one tool call a turn: every turn is asked for one")
    return single


# runner, tokenizer, model name, max model length, the model's sampling defaults
Built = tuple[Runner, Tokenizer, str, int, GenerationDefaults]


def _build_runner(options: ModelOptions) -> tuple[Built, Ranks | None]:
    """The runner and what the engine needs of the model, and the tensor-parallel ranks when
    there are several; ValueError naming what is wrong."""
    if options.model.startswith("sim:"):
        import torch

        from daemon.model import sim
        from daemon.model.parallel.group import threads_per_rank

        tick_s = sim.parse_spec(options.model)
        if options.kv_cache_mib:
            raise ValueError("--kv-cache-mib sizes real KV tensors; a sim: model has none, "
                             "give it --kv-cache-blocks")
        if options.tensor_parallel_size > 1:
            raise ValueError("a sim: model has no weights to split; --tensor-parallel-size "
                             "must be 1")
        # The sampler's threads, as a model's (below): on shared cores a second thread made
        # every softmax wait milliseconds for it.
        torch.set_num_threads(threads_per_rank(options.threads, 1))
        tokenizer = sim.SimTokenizer()
        return (sim.SimRunner(tokenizer, options.kv_cache_blocks, tick_s), tokenizer,
                options.model, sim.SIM_MAX_MODEL_LEN, GenerationDefaults()), None
    from daemon.model.config import ConfigError
    from daemon.model.loader import ModelLoadError
    from daemon.model.parallel.group import StartError
    from daemon.model.parallel.load import load_runner

    # Threads: a core left to the proxy and the kernel keeps ticks short when everything shares
    # a small machine (on 2 cores, 1 thread halved the mean abort latency: docs/benchmarks.md),
    # and what remains is shared out between the tensor-parallel ranks (load_runner).
    try:
        loaded, runner, ranks = load_runner(options)
    except (ModelLoadError, ConfigError, StartError, OSError) as e:
        raise ValueError(str(e)) from e
    log.info("forward pass on %s kernels", loaded.kernels)
    try:
        defaults = msgspec.convert(loaded.generation_defaults, GenerationDefaults)
    except msgspec.ValidationError as e:
        if ranks is not None:
            ranks.close()
        raise ValueError(f"{options.model}: the model's sampling default {e} (a request could "
                         "not ask for it)") from e
    if loaded.generation_defaults:
        log.info("the model's sampling defaults, for requests that omit them: %s",
                 loaded.generation_defaults)
    return (runner, loaded.tokenizer, loaded.name, loaded.max_model_len, defaults), ranks


def _install_signals(server: DaemonServer) -> dict[int, Callable[..., object] | int | None]:
    def on_signal(signum: int, frame: FrameType | None) -> None:
        server.request_stop(force=server.stop_deadline is not None)

    previous: dict[int, Callable[..., object] | int | None] = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous[signum] = signal.signal(signum, on_signal)
    return previous
