"""The engine: sessions in, Delta/Finish records out. No I/O; the server drives it.

A tick is: schedule -> forward -> sample -> detokenize -> emit. Aborts are applied by the caller
between ticks (`abort` evicts at once), so no forward pass that starts after an abort was read
includes the aborted session.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

import torch

from daemon.engine.admission import (
    Tombstones,
    build_sequences,
    check_limits,
    check_sequences,
    max_token_bytes,
    render_prompts,
)
from daemon.engine.block_manager import BlockManager
from daemon.engine.figures import Figures
from daemon.engine.guided import Guidance, check_guide
from daemon.engine.sampler import Sampler, prompt_logprobs, sampled_logprobs
from daemon.engine.scheduler import Scheduler
from daemon.engine.sequence import Detokenizer, Sequence, Session
from daemon.engine.stored import StoredTurns, unbuilt_finishes
from daemon.engine.tokenize import tokenize
from daemon.model.batch import ScheduledChunk
from daemon.model.tokenizer import Tokenizer
from daemon.rejected import ContextBytes, Rejected
from daemon.responses.lifecycle import Aborted, Ending, Failed, History, Responses, Store
from ipc.records import (
    AbortCause,
    Admitted,
    Delta,
    Finish,
    FinishReason,
    RequestKind,
    Submit,
    TokenLogprob,
)
from ipc.stats import Stats
from ipc.wire import ToProxy


class Runner(Protocol):
    block_size: int
    num_blocks: int

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor: ...
    def copy_block(self, src: int, dst: int) -> None: ...


def _default_detokenizer(tokenizer: Tokenizer) -> Callable[[list[int]], Detokenizer]:
    from daemon.model.tokenizer import incremental_detokenizer

    return lambda prompt_ids: incremental_detokenizer(tokenizer, prompt_ids)


class Engine:
    def __init__(self, runner: Runner, tokenizer: Tokenizer, store: Store | None,
                 max_num_seqs: int, max_tokens_per_tick: int, max_model_len: int,
                 model_name: str, *, make_detokenizer: Callable[[list[int]], Detokenizer] | None = None,
                 clock: Callable[[], float] = time.monotonic, prefix_caching: bool = True,
                 guidance: Guidance | None = None,
                 max_seqs_per_request: int | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        # A stored response's whole life goes through here, off the tick: a failing or slow
        # store costs the sessions that need it, nobody else.
        self.responses = Responses(store) if store is not None else None
        self.max_num_seqs = max_num_seqs
        self.max_seqs_per_request = max_seqs_per_request  # None: only n <= max_num_seqs
        self.max_model_len = max_model_len
        # The most text a prompt that fits can hold: what a longer one is refused by, untokenized.
        self.context_bytes = ContextBytes(max_model_len, max_token_bytes(tokenizer))
        self.model_name = model_name
        self.clock = clock
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size,
                                          enable_caching=prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_tokens_per_tick,
                                   runner.copy_block)
        self.sampler = Sampler(tokenizer.eos_token_ids)
        self.guidance = guidance  # constrained decoding; None: guided requests are refused
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._make_detok = make_detokenizer or _default_detokenizer(tokenizer)
        self.sessions: dict[str, Session] = {}
        self.tombstones = Tombstones(clock=clock)
        self.figures = Figures(clock)
        self.stored = (StoredTurns(self.responses, self.figures) if self.responses is not None
                       else None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def waiting_for_grammar(self) -> bool:
        return self.guidance is not None and self.guidance.num_pending > 0

    @property
    def waiting_for_store(self) -> bool:  # turns that load, or whose result is being stored
        return self.stored is not None and self.stored.waiting

    def is_running(self, rid: str) -> bool:
        return rid in self.sessions

    # --- admission ------------------------------------------------------------------------------

    def submit(self, rec: Submit) -> list[ToProxy]:
        """Admit a request: [Admitted], or its refusal (an Error, or Finishes if it was aborted
        before it arrived). A Responses turn that needs the store is admitted pending, as a
        guided one is: its sequences come once the store thread has loaded it."""
        tombstone = self.tombstones.pop(rec.rid)
        if tombstone is not None:
            return self.refuse(rec, *tombstone)
        if rec.rid in self.sessions:
            return [Rejected(f"request id {rec.rid!r} is already running", status=409)
                    .to_error(rec.rid)]
        if rec.kind is RequestKind.TOKENIZE or rec.kind is RequestKind.DETOKENIZE:
            return tokenize(rec, self.tokenizer)
        try:
            check_guide(rec, self.guidance)
            if self.stored is not None and Responses.needs_store(rec):
                self.sessions[rec.rid] = session = self._new_session(rec, [])
                self.stored.load(rec, session, self._prompts)
                return [Admitted(rec.rid)]
            history = self.responses.history if self.responses is not None else None
            session = self._new_session(rec, self._sequences(rec, self._prompts(rec, history)))
        except Rejected as e:
            return [e.to_error(rec.rid)]
        self._admit(session, rec)
        return [Admitted(rec.rid)]

    def _prompts(self, rec: Submit, history: History | None) -> list[list[int]]:
        """A request's prompts, or Rejected (on the store thread for a stored turn's: it may
        not change the engine)."""
        prompts = render_prompts(rec, self.tokenizer, history, self.context_bytes)
        check_sequences(rec, self.max_num_seqs, self.max_seqs_per_request)
        check_limits(rec, prompts, self.max_model_len, self.block_manager,
                     self.tokenizer.vocab_size)
        return prompts

    def _admit(self, session: Session, rec: Submit) -> None:
        self.sessions[rec.rid] = session
        guide = rec.sampling.guide
        if guide is not None and self.guidance is not None:
            self.guidance.wait(session, guide)  # scheduled once its grammar is ready
        else:
            self._schedule(session)

    def _schedule(self, session: Session) -> None:
        """Sample 0 of each prompt to the scheduler; its siblings fork from it once its prompt
        is prefilled."""
        forked = {id(child) for seq in session.sequences for child in seq.fork_children}
        for seq in session.sequences:
            if id(seq) not in forked:
                self.scheduler.add(seq)

    def admit_guided(self) -> list[ToProxy]:
        """Guided sessions whose grammar is ready join the scheduler; those refused end with
        their Error."""
        if not self.waiting_for_grammar:
            return []
        assert self.guidance is not None
        ready, refused = self.guidance.ready()
        for session in ready:
            self._schedule(session)
        return [self._refuse_admitted(session, rejected) for session, rejected in refused]

    def _refuse_admitted(self, session: Session, rejected: Rejected) -> ToProxy:
        """Refused like a request refused at admission: its placeholder goes with it."""
        del self.sessions[session.rid]
        self._end_response(session, Aborted(AbortCause.CLIENT_DISCONNECT, background=False))
        return rejected.to_error(session.rid)

    def refuse(self, rec: Submit, cause: AbortCause,
               t_disconnect: float | None = None) -> list[ToProxy]:
        """A request ended before it was admitted (aborted while still in the pipe, or sent
        under a stale epoch): counted and logged like any other abort."""
        self.figures.refused(rec, cause, t_disconnect)
        return list(unbuilt_finishes(rec, FinishReason.ABORT, cause, None))

    def set_paused(self, rid: str, paused: bool) -> None:
        """Flow control: stop (or resume) scheduling a session; it keeps its blocks."""
        session = self.sessions.get(rid)
        if session is not None and session.paused != paused:
            session.paused = paused
            self.scheduler.set_paused(session.sequences, paused)

    def _new_session(self, rec: Submit, sequences: list[Sequence]) -> Session:
        """A request's session (a loading turn's without sequences yet: until its load says,
        it may hold a placeholder)."""
        session = Session(rid=rec.rid, epoch=rec.epoch, kind=rec.kind, sequences=sequences,
                          t_arrival=self.clock(), client_id=rec.client_id)
        fields = rec.response
        if rec.kind is RequestKind.RESPONSE and fields is not None and self.responses is not None:
            session.background = fields.background
            session.placeholder = fields.store or fields.background
        return session

    def _sequences(self, rec: Submit, prompts: list[list[int]]) -> list[Sequence]:
        return build_sequences(rec, prompts, self._make_detok, self.tokenizer,
                               self.max_model_len, self.block_manager)

    def from_store(self) -> list[ToProxy]:
        """What the responses room did since the last call: loaded turns join the scheduler
        (or end with their refusal); stored turns' last Finishes go out."""
        if self.stored is None:
            return []
        ready, refused, out = self.stored.take()
        for turn in ready:
            rec, session = turn.loading.submit, turn.loading.session
            session.placeholder = turn.placeholder
            session.sequences = self._sequences(rec, turn.prompts)
            self._admit(session, rec)
        return out + [self._refuse_admitted(session, rejected) for session, rejected in refused]

    # --- aborts ---------------------------------------------------------------------------------

    def abort(self, rid: str, cause: AbortCause, t_disconnect: float | None = None,
              t_read: float | None = None) -> list[Finish]:
        """End a session now. Idempotent; an unknown rid becomes a tombstone."""
        session = self.sessions.get(rid)
        if session is None:
            self.tombstones.add(rid, cause, t_disconnect)
            return []
        session.t_disconnect = t_disconnect
        return self._evict(session, cause, t_read=t_read)

    def abort_epoch_older_than(self, epoch: int, cause: AbortCause) -> list[Finish]:
        """Sessions of an earlier proxy (its clients are gone); background ones keep running."""
        return self._abort_where(lambda s: s.epoch < epoch and not s.background, cause)

    def abort_all(self, cause: AbortCause) -> list[Finish]:
        """Every session; when only the proxy is lost, background responses keep running."""
        keep_background = cause is AbortCause.PROXY_LOST
        return self._abort_where(lambda s: not (keep_background and s.background), cause)

    def fail_all(self, message: str) -> list[Finish]:
        """The forward pass failed: end every session with an error."""
        out: list[Finish] = []
        for session in list(self.sessions.values()):
            out += self._evict(session, None, error=message)
        return out

    def _abort_where(self, pred: Callable[[Session], bool], cause: AbortCause) -> list[Finish]:
        out: list[Finish] = []
        for session in [s for s in self.sessions.values() if pred(s)]:
            out += self._evict(session, cause)
        return out

    def _evict(self, session: Session, cause: AbortCause | None, *, error: str | None = None,
               t_read: float | None = None) -> list[Finish]:
        """Release everything the session holds (blocks, queue slots, its placeholder, its
        pending compile or load) and report its end. `cause` None means the session failed
        with `error`."""
        reason = FinishReason.ERROR if cause is None else FinishReason.ABORT
        loading = self.stored.drop(session.rid) if self.stored is not None else None
        if loading is not None:  # nothing of it was built, nor will be
            out = unbuilt_finishes(loading.submit, reason, cause, error)
        else:
            ended = session.end(reason)
            for seq in ended:
                self._release(seq)
            if self.guidance is not None:
                self.guidance.drop(session.rid)
            out = [Finish(session.rid, s.index, reason, s.usage, cause=cause, message=error)
                   for s in ended]
        del self.sessions[session.rid]
        self._end_response(session, Failed(error or "internal error") if cause is None
                           else Aborted(cause, session.background, session.output_text(),
                                        session.usage))
        self.figures.evicted(session, reason, cause, t_read)
        return out

    # --- one tick -------------------------------------------------------------------------------

    def step(self) -> list[ToProxy]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        t_start = self.clock()
        rids = frozenset([s.rid for s in batch.seqs])
        self.figures.tick(t_start, rids, batch.num_prefill_tokens)
        # The masks of this tick depend only on tokens already sampled: they are computed on a
        # thread while the forward pass runs. (A fork's siblings share their prompt's grammar.)
        guidance = (self.guidance if self.guidance is not None
                    and any(s.constraint is not None for s in batch.seqs) else None)
        masks = guidance.start_masks(batch.sampled()) if guidance is not None else None
        logits = self.runner.run(batch.chunks)
        rows, seqs = self.scheduler.postprocess(batch)
        if any(chunk.all_logits for chunk in batch.chunks):
            prompt_logprobs(batch.chunks, batch.seqs, logits, self._token_logprob)
        sampled: Counter[str] = Counter([seq.rid for seq in seqs])
        for rid in rids:
            session = self.sessions[rid]
            if session.placeholder and not session.ticks and self.responses is not None:
                self.responses.started(rid)
            session.ticks.append(t_start, sampled[rid])
        if not seqs:
            return []
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, device=logits.device)]
        failed: list[tuple[Sequence, Rejected]] = []
        if guidance is None:
            tokens = self.sampler(logits, seqs)
        else:
            tokens = self.sampler(guidance.mask(logits, masks), seqs)
            tokens, failed = guidance.accept(seqs, tokens, self.max_model_len, masks)
        self.sampler.count(seqs, tokens)
        logprobs = sampled_logprobs(logits, seqs, tokens)
        if not failed:
            return self._emit(seqs, tokens, logprobs)
        out = self._refuse_running(failed)
        kept = [i for i, seq in enumerate(seqs) if seq.rid in self.sessions]
        return out + self._emit([seqs[i] for i in kept], [tokens[i] for i in kept],
                                [logprobs[i] for i in kept])

    def _refuse_running(self, failed: list[tuple[Sequence, Rejected]]) -> list[ToProxy]:
        """Running sessions that their own request ended (a grammar reached its parser
        limits): released as a failure is, and their clients told with the request's error in
        place of the Finishes."""
        out: list[ToProxy] = []
        for seq, rejected in failed:
            session = self.sessions.get(seq.rid)
            if session is not None:
                self._evict(session, None, error=rejected.message)
                out.append(rejected.to_error(seq.rid))
        return out

    def _emit(self, seqs: list[Sequence], tokens: list[int],
              logprobs: list[tuple[float, list[tuple[int, float]]] | None]) -> list[ToProxy]:
        out: list[ToProxy] = []
        append = self._append
        for seq, token, lp in zip(seqs, tokens, logprobs, strict=True):
            if seq.echo is not None:  # the answer starts with the prompt
                out += seq.echo.deltas(seq.rid, seq.index)
                seq.echo = None
            if lp is not None:
                seq.pending_logprobs.append(self._token_logprob(token, lp))
            text, reason, first = append(seq, token)
            # Every sampled id reaches the client once (a stop token's too, though not its text),
            # so token_ids summed over a stream equal usage.completion_tokens.
            pending = seq.pending_token_ids
            if text or (reason is not None and pending):
                seq.output_pieces.append(text)
                out.append(Delta(seq.rid, seq.index, text, pending,
                                 seq.pending_logprobs if lp is not None else None,
                                 prompt_tokens=seq.num_prompt_tokens if first else 0))
                seq.pending_token_ids = []
                if lp is not None:
                    seq.pending_logprobs = []
            if reason is not None:
                out += self._finish(seq, reason)
        self.figures.num_generation_tokens += len(tokens)
        return out

    def _token_logprob(self, token: int, lp: tuple[float, list[tuple[int, float]]]) -> TokenLogprob:
        raw = self.tokenizer.token_bytes
        return TokenLogprob(raw(token), lp[0], [(raw(t), v) for t, v in lp[1]])

    def _append(self, seq: Sequence, token: int) -> tuple[str, FinishReason | None, bool]:
        """Add a sampled token; return the text it releases, the finish reason if any, and
        whether the pending ids start with the sequence's first generated token."""
        token_ids = seq.token_ids
        token_ids.append(token)
        pending = seq.pending_token_ids
        pending.append(token)
        p = seq.params
        num_tokens = len(token_ids)  # read once: this runs for every token of every stream
        generated = num_tokens - seq.num_prompt_tokens
        first = generated == len(pending)
        if generated >= p.min_tokens and (
                token in p.stop_token_ids or (token in self._eos and not p.ignore_eos)):
            return self._final_text(seq), FinishReason.STOP, first
        text = seq.detok.push(token)
        stops = seq.stops
        if stops.stops:  # stop strings to match: most sequences have none
            text = stops.push(text, generated >= p.min_tokens)
            if stops.stopped:
                return text, FinishReason.STOP, first
        if generated >= seq.max_tokens or num_tokens >= self.max_model_len:
            return text + self._final_text(seq), FinishReason.LENGTH, first
        return text, None, first

    @staticmethod
    def _final_text(seq: Sequence) -> str:
        """Text held back by the detokenizer and the stop matcher, at the end of a sequence."""
        text = seq.stops.push(seq.detok.flush())
        return text if seq.stops.stopped else text + seq.stops.flush()

    def _release(self, seq: Sequence) -> None:
        """What one sequence holds: its place and blocks, and the sampler's state for it."""
        self.scheduler.remove(seq)
        self.sampler.release(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> list[ToProxy]:
        seq.finish_reason = reason
        self._release(seq)
        session = self.sessions[seq.rid]
        finish = Finish(seq.rid, seq.index, reason, seq.usage, stop=seq.stops.matched)
        if not session.is_finished:
            return [finish]
        del self.sessions[seq.rid]
        if session.placeholder and self.stored is not None:
            self.stored.store(session, finish)  # its client hears it once it is stored
            return []
        self.figures.completed(session, reason, None)
        return [finish]

    def _end_response(self, session: Session, ending: Ending) -> None:
        """Tells the responses room how a session that may hold a placeholder ended."""
        if session.placeholder and self.responses is not None:
            session.placeholder = False
            self.responses.ended(session.rid, ending)

    # --- figures --------------------------------------------------------------------------------

    def stats(self) -> Stats:
        """Gauges and counters now; latency observations since the previous call."""
        # Requests, not sequences: a request runs while any of its sequences does.
        running = len({seq.rid for seq in self.scheduler.running})
        bm = self.block_manager
        stats = self.figures.stats(
            running=running, waiting=len(self.sessions) - running,
            kv_blocks_used=bm.num_used, kv_blocks_total=bm.num_total,
            kv_blocks_cached=bm.num_cached_free,
            prefix_cache_queries=self.scheduler.num_cache_queries,
            prefix_cache_hits=self.scheduler.num_cache_hits,
            placeholders=self._num_placeholders(),
            paused=sum(1 for s in self.sessions.values() if s.paused))
        if self.responses is not None:
            stats.conversations, stats.conversation_items = self.responses.conversation_counts()
        if self.guidance is not None:
            grammars = self.guidance.grammars
            stats.grammar_compiles, stats.grammar_cache_hits = grammars.num_misses, grammars.num_hits
            stats.grammar_cache_bytes = grammars.num_cached_bytes
            stats.grammar_pending = self.guidance.num_pending
            stats.grammar_compile_obs = grammars.take_compile_obs()
        return stats

    def _num_placeholders(self) -> int:
        """Counted here: the store thread learns of an end after the tick that applied it."""
        storing = self.stored.num_storing if self.stored is not None else 0
        return storing + sum(1 for s in self.sessions.values() if s.placeholder)
