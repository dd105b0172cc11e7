"""The engine's side of constrained decoding (daemon/engine/grammar.py): sessions waiting for
their grammar, the masks of a tick, and the tokens the constraints let through.

A guided session is admitted (its client hears Admitted) but its sequences reach the scheduler
only once its grammar is compiled (with its first closing: no search for one runs on the tick
at admission), so one whose client leaves meanwhile is never prefilled: its eviction drops the
pending compile like everything else it holds. A compile that fails, or takes longer than the
timeout, refuses that request; so is a matcher that reaches its parser limits mid-output.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import llguidance
import torch

from daemon.engine.bitmask import Bitmask, apply_bitmask
from daemon.engine.closing import SearchBound
from daemon.engine.constraint import (
    TICK_DRAFT_S,
    TICK_DRAFT_STEPS,
    TICK_SEARCH_S,
    Constraint,
    search_bound,
)
from daemon.engine.grammar import Compiled, GrammarError, Grammars
from daemon.engine.json_numbers import NumberGuard, guards_numbers
from daemon.engine.sequence import Sequence
from daemon.engine.session import Session
from daemon.rejected import Rejected
from ipc.reasons import Reason
from ipc.records import Guide, RequestKind, Submit

log = logging.getLogger(__name__)

DEFAULT_COMPILE_TIMEOUT_S = 10.0
# Below this many token slots (rows x vocabulary) a tick's masks take less than the hop to the
# mask thread and back (about 30 us here, what 64 rows of the byte vocabulary take inline).
MASK_THREAD_MIN_TOKENS = 1 << 20


@dataclass(slots=True)
class Masks:
    """A tick's masks: `bitmask[j]` is for sampled row `rows[j]`, once `future` is done;
    `spans[i]`: sequence i's (a drafted one has a row per position)."""

    rows: list[int]
    bitmask: Bitmask
    future: Future[None] | None
    spans: dict[int, range]


@dataclass(slots=True)
class _Pending:
    session: Session
    guide: Guide
    future: Future[Compiled]
    deadline: float


class Guidance:
    def __init__(self, grammars: Grammars, compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.grammars = grammars
        self.compile_timeout_s = compile_timeout_s
        self.clock = clock
        self._pending: dict[str, _Pending] = {}

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def wait(self, session: Session, guide: Guide) -> None:
        """Compile the session's grammar; `ready` hands the session back once it is."""
        self._pending[session.rid] = _Pending(session, guide, self.grammars.compile(guide),
                                              self.clock() + self.compile_timeout_s)

    def drop(self, rid: str) -> None:
        """The session ended while its grammar compiled: nothing of it is kept."""
        pending = self._pending.pop(rid, None)
        if pending is not None:
            pending.future.cancel()

    def ready(self) -> tuple[list[Session], list[tuple[Session, Rejected]]]:
        """Sessions whose grammar is ready (each sequence holding its constraint), and those
        refused: the grammar is invalid, took too long, or cannot fit in max_tokens."""
        if not self._pending:
            return [], []
        now = self.clock()
        ready: list[Session] = []
        refused: list[tuple[Session, Rejected]] = []
        for rid, pending in list(self._pending.items()):
            future = pending.future
            if not future.done() and now < pending.deadline:
                continue
            del self._pending[rid]
            try:
                self._constrain(pending, future)
            except Rejected as e:
                future.cancel()
                refused.append((pending.session, e))
                continue
            ready.append(pending.session)
        return ready, refused

    def _constrain(self, pending: _Pending, future: Future[Compiled]) -> None:
        param = pending.guide.source or None
        if not future.done():
            raise Rejected(f"the grammar took longer than {self.compile_timeout_s:g} s to "
                           "compile", param=param, reason=Reason.GRAMMAR_TIMEOUT)
        try:
            template = future.result()
        except GrammarError as e:
            raise Rejected(f"invalid {pending.guide.kind.value}: {e}", param=param,
                           reason=e.reason) from None
        except Exception as e:  # the grammar library failing on a client's text: its request's
            log.warning("compiling a %s failed unexpectedly", pending.guide.kind.value,
                        exc_info=True)
            raise Rejected(f"the {pending.guide.kind.value} could not be compiled: "
                           f"{type(e).__name__}: {e}", param=param,
                           reason=Reason.INVALID_GRAMMAR) from None
        seqs = pending.session.sequences
        first = seqs[0]
        left = _tokens_left(first, first.max_tokens)
        need = template.start.cost + 1  # the shortest output found, and the end of sequence
        if need > left:
            name = ("max_output_tokens" if pending.session.kind is RequestKind.RESPONSE
                    else "max_tokens")
            raise Rejected(f"{name} ({left}) is too small for the shortest output the "
                           f"{pending.guide.kind.value} allows, which takes {need} tokens: "
                           f"set {name} to at least {need}", param=name,
                           reason=Reason.MAX_TOKENS_TOO_SMALL)
        json = guards_numbers(pending.guide)
        for seq in seqs:
            seq.constraint = Constraint(self.grammars, template.copy(),
                                        NumberGuard() if json else None)

    # --- one tick -------------------------------------------------------------------------------

    def start_masks(self, seqs: list[Sequence],
                    drafts: dict[int, list[int]] | None = None) -> Masks | None:
        """Starts computing the masks of the constrained ones among `seqs` (the tick's sampled
        sequences, in order; `drafts`: by index, the drafts of those that have any, whose
        sampled rows follow theirs); None when none is constrained. Most were computed when the
        last token was consumed (`accept`). A drafted one has a row per position, each the mask
        after the drafts before it (llguidance advances its matcher through them and rolls it
        back). Masks worth a thread (many rows of a large vocabulary) are computed on the mask
        thread while the forward pass runs, and until `mask` has waited for them their matchers
        are the thread's; the others at once, since a hop to a thread and back costs more than
        they do."""
        drafts = drafts or {}
        rows: list[int] = []
        spans: dict[int, range] = {}
        at = 0  # sampled row
        for i, seq in enumerate(seqs):
            n = 1 + len(drafts.get(i, ()))
            if seq.constraint is not None:
                spans[i] = range(len(rows), len(rows) + n)
                rows += range(at, at + n)
            at += n
        if not rows:
            return None
        bitmask = self.grammars.new_bitmask(len(rows))
        free: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        for i, span in spans.items():
            constraint = seqs[i].constraint
            assert constraint is not None
            drafted = drafts.get(i, [])
            if not constraint.fill_known(bitmask, span[0], len(drafted)):
                free.append((constraint.matcher, span[0], drafted))
        if not free or not self._worth_a_thread(sum([1 + len(d) for _, _, d in free])):
            self.grammars.fill_masks_now(free, bitmask)
            return Masks(rows, bitmask, None, spans)
        return Masks(rows, bitmask, self.grammars.fill_masks(free, bitmask), spans)

    def draft_bound(self) -> SearchBound:
        """The bound of a tick's grammar work for speculative drafts (Speculation's)."""
        return SearchBound(TICK_DRAFT_STEPS, self.clock() + TICK_DRAFT_S, self.clock)

    def mask(self, logits: torch.Tensor, masks: Masks | None) -> torch.Tensor:
        """`logits` with every token a constrained row forbids at -inf (a copy: the model's own
        logits stay for the reported log-probabilities); the same tensor when none is."""
        if masks is None:
            return logits
        if masks.future is not None:
            masks.future.result()
        masked = logits.clone()
        apply_bitmask(masked, masks.rows, masks.bitmask)
        return masked

    def _worth_a_thread(self, rows: int) -> bool:
        return rows * self.grammars.vocab_size >= MASK_THREAD_MIN_TOKENS

    def accept(self, seqs: list[Sequence], rows: list[list[int]], max_model_len: int,
               masks: Masks | None = None,
               ) -> tuple[list[list[int]], list[tuple[Sequence, Rejected]]]:
        """The tokens to emit, each sequence's in its row: each constraint consumes its
        sequence's sampled tokens in order, or puts the next token of its closing in place of
        one (daemon/engine/constraint.py), which is then the row's last (the tokens after it
        followed another output); and computes its next mask unless the mask thread will
        (`masks`: the step's, which say whether each row's first token was allowed). Also the
        sequences whose grammar reached its parser limits, each with its request's refusal (their
        tokens are not to be emitted). The step's closing searches share one deadline."""
        out = rows
        failed: list[tuple[Sequence, Rejected]] = []
        spans = masks.spans if masks is not None else {}
        now = not self._worth_a_thread(len(spans))
        searches_end = self.clock() + TICK_SEARCH_S
        for i, seq in enumerate(seqs):
            constraint = seq.constraint
            if constraint is None:
                continue
            try:
                row, left = self._accept_row(seq, constraint, rows[i], max_model_len,
                                             masks, spans.get(i, range(0)), searches_end)
            except GrammarError as e:
                guide = seq.params.guide
                failed.append((seq, Rejected(str(e), param=guide.source or None if guide else None,
                                             reason=e.reason)))
                continue
            if now and left > 1:
                constraint.compute_mask()
            if row is not rows[i]:
                if out is rows:
                    out = list(rows)
                out[i] = row
        return out, failed

    def _accept_row(self, seq: Sequence, constraint: Constraint, row: list[int],
                    max_model_len: int, masks: Masks | None, span: range,
                    searches_end: float) -> tuple[list[int], int]:
        """One sequence's tokens as its constraint lets them through (the row itself when it
        takes them all), and the tokens it had left at the last of them; token `at` was
        sampled under mask row `span[at]` (the mask after the tokens before it), where it has
        one. (Past an end of sequence it allows nothing else: the rest are replaced and cut at
        once.)"""
        clock = self.clock
        left = 0
        for at, token in enumerate(row):
            # Tokens this sequence may still generate, this one included.
            left = min(_tokens_left(seq, seq.max_tokens) - at,
                       max_model_len - seq.num_tokens - at)
            allowed = (masks.bitmask.allows(span[at], token)
                       if masks is not None and at < len(span) else None)
            emitted = constraint.accept(token, left, allowed, search_bound(clock(), searches_end))
            if emitted != token:
                return [*row[:at], emitted], left
        return row, left

    def close(self) -> None:
        for rid in list(self._pending):
            self.drop(rid)
        self.grammars.close()


def check_guide(submit: Submit, guidance: Guidance | None) -> None:
    """Refuses what a guided request cannot have: no grammar engine, or an end of sequence
    the grammar cannot rely on."""
    guide = submit.sampling.guide
    if guide is None:
        return
    if guidance is None:
        raise Rejected("constrained decoding is not available on this server",
                       param=guide.source or None)
    if submit.sampling.ignore_eos:
        raise Rejected(f"ignore_eos cannot be combined with {guide.source or 'a guide'}: a "
                       "constrained output ends with the end of sequence", param="ignore_eos")
    if submit.sampling.min_tokens:
        raise Rejected(f"min_tokens cannot be combined with {guide.source or 'a guide'}: the "
                       "grammar decides where the output ends", param="min_tokens")


def _tokens_left(seq: Sequence, max_tokens: int) -> int:
    """Tokens this sequence may still generate, the next one included."""
    return max_tokens - seq.num_generated
