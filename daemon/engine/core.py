"""The engine: sessions in, Delta/Finish records out. No I/O; the server drives it.

A step is four phases, each a method and each timed: schedule (the scheduler's batch) ->
execute (the forward pass, sampling beside it: daemon/engine/execute.py) -> update (the
scheduler's bookkeeping from the sampled ids: daemon/engine/update.py) -> emit (text, stop
strings, records: daemon/engine/output.py). Aborts are applied by the caller between steps
(`abort` evicts at once), so no forward pass that starts after an abort was read includes the
aborted session.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from time import perf_counter

from daemon.engine.admission import Tombstones
from daemon.engine.batch import Batch
from daemon.engine.block_manager import BlockManager
from daemon.engine.execute import Executed, Executor, Runner
from daemon.engine.figures import Figures
from daemon.engine.gauges import engine_stats
from daemon.engine.guided import Guidance, check_guide
from daemon.engine.intake import Intake
from daemon.engine.output import Detokenizer
from daemon.engine.sampler import Logprob, Sampler, sampled_logprobs
from daemon.engine.scheduler import Scheduler
from daemon.engine.sequence import Sequence
from daemon.engine.session import Session
from daemon.engine.speculative import NgramConfig, Speculation
from daemon.engine.stored import StoredTurns, unbuilt_finishes
from daemon.engine.tokenize import tokenize
from daemon.engine.update import Advanced, Ends
from daemon.model.tokenizer import Tokenizer
from daemon.rejected import Rejected
from daemon.responses.lifecycle import Aborted, Ending, Failed, Responses, Store
from ipc.reasons import Reason
from ipc.records import (
    AbortCause,
    Admitted,
    Finish,
    FinishReason,
    RequestKind,
    Submit,
    TokenLogprob,
)
from ipc.stats import Stats
from ipc.wire import ToProxy

__all__ = ["Engine", "Runner"]


class Engine:
    def __init__(self, runner: Runner, tokenizer: Tokenizer, store: Store | None,
                 max_num_seqs: int, max_tokens_per_tick: int, max_model_len: int,
                 model_name: str, *, make_detokenizer: Callable[[list[int]], Detokenizer] | None = None,
                 clock: Callable[[], float] = time.monotonic, prefix_caching: bool = True,
                 guidance: Guidance | None = None,
                 max_seqs_per_request: int | None = None,
                 speculative: NgramConfig | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        # A stored response's whole life goes through here, off the tick: a failing or slow
        # store costs the sessions that need it, nobody else.
        self.responses = Responses(store) if store is not None else None
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.clock = clock
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size,
                                          enable_caching=prefix_caching)
        self.speculation = (Speculation(speculative, guidance.draft_bound if guidance else None)
                            if speculative is not None else None)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_tokens_per_tick,
                                   runner.copy_block, self.speculation)
        self.sampler = Sampler(tokenizer.eos_token_ids)
        self.guidance = guidance  # constrained decoding; None: guided requests are refused
        self.executor = Executor(runner, self.sampler, guidance, self._token_logprob)
        self.ends = Ends(tokenizer.eos_token_ids, max_model_len)
        self.intake = Intake(tokenizer, self.block_manager, max_num_seqs, max_model_len, clock,
                             make_detokenizer=make_detokenizer,
                             max_seqs_per_request=max_seqs_per_request,
                             stores=self.responses is not None)
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
            return [Rejected(f"request id {rec.rid!r} is already running", Reason.DUPLICATE_ID)
                    .to_error(rec.rid)]
        if rec.kind is RequestKind.TOKENIZE or rec.kind is RequestKind.DETOKENIZE:
            return tokenize(rec, self.tokenizer)
        try:
            check_guide(rec, self.guidance)
            if self.stored is not None and Responses.needs_store(rec):
                self.sessions[rec.rid] = session = self.intake.session(rec, ([], []))
                self.stored.load(rec, session, self.intake.prompts)
                return [Admitted(rec.rid)]
            history = self.responses.history if self.responses is not None else None
            intake = self.intake
            session = intake.session(rec, intake.build(rec, intake.prompts(rec, history)))
        except Rejected as e:
            return [e.to_error(rec.rid)]
        self._admit(session, rec)
        return [Admitted(rec.rid)]

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

    def from_store(self) -> list[ToProxy]:
        """What the responses room did since the last call: loaded turns join the scheduler
        (or end with their refusal); stored turns' last Finishes go out."""
        if self.stored is None:
            return []
        ready, refused, out = self.stored.take()
        for turn in ready:
            rec, session = turn.loading.submit, turn.loading.session
            session.placeholder = turn.placeholder
            session.sequences, session.outputs = self.intake.build(rec, turn.prompts)
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

    # --- one step: schedule -> execute -> update -> emit --------------------------------------

    def step(self) -> list[ToProxy]:
        """One step, phase by phase, each timed (Figures.phases). Aborts were applied before
        it: the server drains control first, so no session evicted then is in its batch."""
        laps = [perf_counter()]  # when each phase ended, in order
        batch = self.schedule()
        if not batch:
            return []
        laps.append(perf_counter())
        executed = self.execute(batch)
        laps.append(perf_counter())
        advanced, out = self.update(batch, executed)
        laps.append(perf_counter())
        out += self.emit(advanced)
        laps.append(perf_counter())
        self.figures.timed(laps)
        return out

    def schedule(self) -> Batch:
        """What this step's forward pass computes (the scheduler's decisions), counted."""
        batch = self.scheduler.schedule()
        if batch:
            self.figures.tick(self.clock(), frozenset([s.rid for s in batch.seqs]),
                              batch.num_prefill_tokens)
        return batch

    def execute(self, batch: Batch) -> Executed:
        """The forward pass and sampling: the sampled ids, still where the logits are."""
        return self.executor(batch)

    def update(self, batch: Batch, executed: Executed) -> tuple[Advanced, list[ToProxy]]:
        """The bookkeeping the sampled ids call for: positions computed, blocks cached and
        forked, each sequence's new tokens (as its grammar lets them through, up to the one
        that ends it), the penalty counts, their log-probabilities. Also the Errors of the
        sessions whose grammar failed (ended here)."""
        seqs, rows, starts = executed.seqs, executed.rows(), executed.starts
        kept: dict[int, int] = {}
        if executed.drafts and self.speculation is not None:  # rows cut to what they keep
            kept = self.speculation.verify(seqs, executed.drafts, rows)
        failed: list[tuple[Sequence, Rejected]] = []
        if executed.masks is not None and self.guidance is not None:
            rows, failed = self.guidance.accept(seqs, rows, self.max_model_len, executed.masks)
        # A grammar that put its closing's token in place of one keeps only the drafts before
        # it: the KV of those after was computed for other tokens.
        self.scheduler.update(batch, {seqs[i].seq_id: min(n, len(rows[i]) - 1)
                                      for i, n in kept.items()} if kept else None)
        self._count_tick(seqs, rows, starts is not None)
        refused = self._refuse_running(failed) if failed else []
        if refused:  # their sequences, and their siblings, get nothing more
            at = [i for i, seq in enumerate(seqs) if seq.rid in self.sessions]
            seqs, rows = [seqs[i] for i in at], [rows[i] for i in at]
            starts = [i if starts is None else starts[i] for i in at]
        ended = self.ends.append(seqs, rows)  # cuts a row at the token that ends it
        logprobs = sampled_logprobs(executed.logits, seqs, rows, starts, self._token_logprob)
        self.sampler.count(seqs, rows)
        self.figures.num_generation_tokens += len(rows) if starts is None else sum(map(len, rows))
        return Advanced(seqs, rows, logprobs, ended), refused

    def emit(self, advanced: Advanced) -> list[ToProxy]:
        """The records of the step's new tokens: text, stop strings, Deltas, Finishes."""
        out: list[ToProxy] = []
        sessions = self.sessions
        for seq, tokens, logprobs, ended in zip(advanced.seqs, advanced.rows, advanced.logprobs,
                                                advanced.ended, strict=True):
            output = sessions[seq.rid].outputs[seq.index]
            reason = output.push(seq, tokens, logprobs, ended, out)
            if reason is not None:
                out += self._finish(seq, reason)
        return out

    def _count_tick(self, seqs: list[Sequence], rows: list[list[int]], several: bool) -> None:
        """Each session in the step: the tokens it got (for "tokens after the client left"),
        and a stored response's first step marks it started."""
        tick = self.figures.tick_log[-1]
        sampled = Counter([seq.rid for seq, row in zip(seqs, rows, strict=True) for _ in row]
                          if several else [seq.rid for seq in seqs]).get
        sessions, start = self.sessions, tick.start
        for rid in tick.rids:
            session = sessions[rid]
            if session.placeholder and not session.ticks and self.responses is not None:
                self.responses.started(rid)
            session.ticks.append(start, sampled(rid, 0))

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

    def _token_logprob(self, token: int, lp: Logprob) -> TokenLogprob:
        raw = self.tokenizer.token_bytes
        return TokenLogprob(raw(token), lp[0], [(raw(t), v) for t, v in lp[1]])

    def _release(self, seq: Sequence) -> None:
        """What one sequence holds: its place and blocks, and the sampler's state for it."""
        self.scheduler.remove(seq)
        self.sampler.release(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> list[ToProxy]:
        seq.finish_reason = reason
        self._release(seq)
        session = self.sessions[seq.rid]
        finish = Finish(seq.rid, seq.index, reason, seq.usage,
                        stop=session.outputs[seq.index].stops.matched)
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
        stats = engine_stats(self.figures, self.scheduler, self.sessions, self.responses,
                             self.guidance, self.stored)
        if self.speculation is not None:
            s = self.speculation
            stats.spec_decode_num_drafts = s.num_drafts
            stats.spec_decode_num_draft_tokens = s.num_draft_tokens
            stats.spec_decode_num_accepted_tokens = s.num_accepted_tokens
        return stats
