"""One sequence's constraint: its matcher, its row of the tick's mask, and the budget that keeps
room to close the output within ``max_tokens`` (daemon/engine/grammar.py says why).

A closing search on the tick happens only after a token that changes the structure, and is
bounded (`search_bound`): in matcher steps, in time per search, and by the tick's deadline for
all its searches (a search past it still gets a floor, enough for a JSON schema's closing, so
that one grammar's cost does not close another's output early). A search that fails within its
bound takes the token back and closes the output from where it was: the output is shorter,
never invalid, and the tick goes on. A matcher that reaches its parser limits raises
GrammarError: its request is refused naming the limit.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

import llguidance

from daemon.engine.bitmask import Bitmask, bit, fill_row
from daemon.engine.closing import Closing, SearchBound, utf8_rest
from daemon.engine.grammar import Compiled, Grammars, parser_limit_error
from daemon.engine.json_numbers import NumberGuard

TICK_SEARCH_STEPS = 4096  # matcher steps one search on the tick may take
SEARCH_S = 0.02  # and seconds
TICK_SEARCH_S = 0.05  # seconds for all of a tick's searches
SEARCH_FLOOR_S = 0.002  # what a search past the tick's deadline still gets
# Speculative decoding's grammar work on the tick (daemon/engine/speculative.py): each draft
# costs two steps (its check when proposed, its mask row in the execute phase), and proposing
# stops at the tick's deadline for it. No floor: a draft cut costs speed, never an output.
TICK_DRAFT_STEPS = 512
TICK_DRAFT_S = 0.005
DRAFT_BYTES_PER_TOKEN = 16  # forced bytes tokenized per draft wanted (fewer: shorter drafts)


def search_bound(now: float, tick_deadline: float) -> SearchBound:
    """The bound of a search starting at `now` in a tick whose searches end at
    `tick_deadline`."""
    return SearchBound(TICK_SEARCH_STEPS, min(now + SEARCH_S,
                                              max(tick_deadline, now + SEARCH_FLOOR_S)))


class Constraint:
    """One sequence's matcher and its budget; advanced once per sampled token.

    The constraint always holds a closing that is valid from the matcher's state and fits in
    the tokens left. Each sampled token is checked against it at the price of one call: when
    the token spells the closing's first bytes the rest still closes; when the closing still
    takes the new state to the end (a character inside a string, a digit) it is kept; only a
    token that changes the structure (a key that opens a required object, an array item) makes
    the constraint search for a closing again. A token that leaves no room for one, or whose
    closing is not found within the search's bound, is taken back, and the output closes from
    where it was."""

    __slots__ = ("_closing", "_forced", "_grammars", "_last", "_mask", "_mask_ready",
                 "_numbers", "_splits", "matcher")

    def __init__(self, grammars: Grammars, compiled: Compiled,
                 numbers: NumberGuard | None = None) -> None:
        self._grammars = grammars
        self.matcher = compiled.matcher
        self._numbers = numbers  # a JSON output's numbers, kept finite
        self._forced: list[int] = []  # the closing being spelled, token by token
        self._mask = array("i", bytes(4 * grammars.mask_width))  # from the matcher's state
        self._mask_ready = False
        self._closing = compiled.start  # from the matcher's state
        self._last: int | None = None  # the last token consumed
        # Tokens this output spelled as two (`_learn`), so drafts spell them so too.
        self._splits: dict[int, tuple[int, int]] = {}

    @property
    def forced(self) -> bool:
        return bool(self._forced)

    def fill(self, bitmask: Bitmask, row: int) -> None:
        """Writes this tick's allowed tokens into row `row` of `bitmask`."""
        if not self.fill_known(bitmask, row):
            fill_row(self.matcher, bitmask, row)

    def fill_known(self, bitmask: Bitmask, row: int, drafts: int = 0) -> bool:
        """`fill` when the allowed tokens are known without the matcher (a forced token, or
        the mask computed when the last token was consumed); False, and nothing written,
        when they are not. `drafts`: this step's drafts (`draft`), whose rows follow `row`,
        each allowing what the grammar allows after the drafts before it."""
        width = bitmask.width
        if self._forced:  # its drafts are the closing's next tokens: a row each, and one more
            zero = self._grammars.zero_mask
            for j, token in enumerate(self._forced[:1 + drafts]):
                at = (row + j) * width
                bitmask.words[at:at + width] = zero
                bitmask.words[at + (token >> 5)] = bit(token & 31)
            return True
        if not self._mask_ready or drafts:
            return False
        at = row * width
        bitmask.words[at:at + width] = self._mask
        return True

    def compute_mask(self) -> None:
        """The allowed tokens from the matcher's state, computed now for the next tick (see
        daemon/engine/grammar.py for why now)."""
        if self._forced or self.matcher.is_stopped():
            return
        self.matcher.unsafe_compute_mask_ptr(int(self._mask.buffer_info()[0]),
                                             4 * len(self._mask))
        self._mask_ready = True

    def draft(self, more: Callable[[list[int], int], list[int]], limit: int,
              bound: SearchBound) -> tuple[list[int], int]:
        """Up to `limit` drafts from here for speculative decoding: the closing being spelled,
        or the bytes the grammar forces, tokenized (`_jump_forward`: a schema's keys and
        punctuation), then `more(forced, room)`'s (the n-gram's), cut at the first the grammar
        refuses; never an end of sequence (its row's mask would allow nothing). Nothing is
        consumed. Each costs `bound` two steps; drafting stops where the bound does. Also how
        many of them, the first, the grammar forces."""
        forced = self._forced
        if forced:  # certain; the row after the last draft must still be the closing's
            drafts = forced[:max(0, min(limit, len(forced) - 1))]
            return drafts, len(drafts)
        matcher = self.matcher
        if limit <= 0 or matcher.is_stopped() or matcher.is_error() or not bound.spend(1):
            return [], 0
        tokens = self._jump_forward(min(limit, bound.steps_left // 2))
        sure = len(tokens)
        if sure < limit:
            tokens += more(tokens, limit - sure)
        tokens = tokens[:min(len(tokens), bound.steps_left // 2)]
        if not tokens or not bound.spend(2 * len(tokens)):
            return [], 0
        tokens = tokens[:matcher.validate_tokens(tokens)]
        eos = self._grammars.eos_ids
        tokens = next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)
        return tokens, min(sure, len(tokens))

    def _jump_forward(self, limit: int) -> list[int]:
        """At most `limit` tokens that spell the bytes the grammar forces from here, as the
        tokenizer spells them, but for the tokens this output split (`_learn`). Not
        llguidance's jump-forward tokens: those stop where the spelling is ambiguous (after a
        key, `":` may start the token `":"`), so they held a key but never its colon, half of
        what a key forces; a spelling the model does not choose costs a rejected draft, never
        an output. Only the bytes `limit` tokens may take are tokenized (forced bytes run up
        to a closing's 4 KB)."""
        forced = self.matcher.compute_ff_bytes()[:DRAFT_BYTES_PER_TOKEN * limit]
        if not forced:
            return []
        splits = self._splits
        tokens = self._grammars.tokenizer.tokenize_bytes(forced)[:limit]
        return [t for token in tokens for t in splits.get(token, (token,))][:limit]

    def feasible(self, left: int) -> bool:
        """Whether an output can still be closed in `left` tokens (a request whose budget
        cannot hold the shortest valid output is refused up front)."""
        return self._closing.cost + 1 <= left

    def accept(self, token: int, left: int, allowed: bool | None = None,
               bound: SearchBound | None = None) -> int:
        """The token to emit for `token` sampled with `left` tokens still allowed (this one
        included; `allowed`: whether this tick's mask let it through, when known): the sampled
        token, or the next of the closing when the sampled one would leave too few to close
        the output, or when its closing is not found within `bound` (by default, one search's
        bound on the tick), or when it would make a JSON number infinite. The matcher has
        consumed what it returns. GrammarError when the matcher reached its parser limits."""
        token = self._accept(token, left, allowed, bound)
        self._learn(token)
        if self._numbers is not None:
            self._numbers.push(self._grammars.token_bytes[token])
        return token

    def _accept(self, token: int, left: int, allowed: bool | None,
                bound: SearchBound | None) -> int:
        self._mask_ready = False
        matcher = self.matcher
        if matcher.is_error():  # the last mask's step reached a limit
            raise parser_limit_error("while writing the output", matcher)
        if self._forced:
            forced = self._forced.pop(0)
            self._consume(forced)
            return forced
        if allowed is None:
            allowed = matcher.validate_tokens([token]) == 1
        if not allowed:
            # Only when every allowed token had no chance under the model (its logits all -inf
            # there): close instead.
            return self._close()
        if bound is None:
            bound = SearchBound.within(TICK_SEARCH_STEPS, SEARCH_S)
        grammars = self._grammars
        if self._numbers is not None and not self._numbers.fits(grammars.token_bytes[token]):
            # A number would grow past binary64: end it. The closing held may go on with its
            # digits (it was kept from before them); a fresh one ends the number first.
            fresh = grammars.exact_closing(matcher, bound)
            if isinstance(fresh, Closing) and fresh.cost < left:
                self._closing = fresh
            return self._close()
        self._consume(token)
        if token in grammars.eos_ids:
            return token
        after = self._follow(token, left - 1, bound)
        if after is not None:
            self._closing = after
            return token
        # No room to close after this token, or no closing found in time: take it back and
        # close from where we were.
        matcher.rollback(1)
        return self._close()

    def _learn(self, token: int) -> None:
        """Notes how this output spells what one token could: a model that writes `":` then
        `"` where its tokenizer has `":"` writes the next key's colon so too, and drafts that
        spell it the tokenizer's way are rejected at every key. The latest spelling counts."""
        last, self._last = self._last, token
        self._splits.pop(token, None)
        if last is None:
            return
        grammars = self._grammars
        joined = grammars.token_ids.get(grammars.token_bytes[last] + grammars.token_bytes[token])
        if joined is not None:
            self._splits[joined] = (last, token)

    def _consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            # The token was allowed (or the closing's, checked): only a limit refuses it.
            raise parser_limit_error("while writing the output", self.matcher)

    def _follow(self, token: int, room: int, bound: SearchBound) -> Closing | None:
        """A closing from the state after `token` that fits in `room` tokens (an end of sequence
        included), or None."""
        grammars, before = self._grammars, self._closing
        kept = _kept(grammars, self.matcher, before, grammars.token_bytes[token], bound)
        if kept is not None and kept.cost + 1 <= room:
            return kept
        found = grammars.exact_closing(self.matcher, bound)  # a new structure, or a bound too loose
        return found if isinstance(found, Closing) and found.cost + 1 <= room else None

    def _close(self) -> int:
        """The first token of the closing from here (an accepting state closes with the end of
        sequence); the rest are forced on the next ticks."""
        grammars = self._grammars
        text = self._closing.text
        tokens = list(grammars.tokenizer.tokenize_bytes(text)) if text else []
        tokens.append(grammars.eos_token_ids[0])
        self._forced = tokens[1:]
        self._consume(tokens[0])
        return tokens[0]


def _kept(grammars: Grammars, matcher: llguidance.LLMatcher, before: Closing, raw: bytes,
          bound: SearchBound) -> Closing | None:
    """The closing from before a token of bytes `raw`, as it still closes from after it: what
    the token did not spell of it (the token was its start, or took the place of its first
    bytes: a character of a fixed-length string, a digit), or all of it (a character of a free
    string); None when the token changed what closing takes."""
    text = before.text
    rest = text[len(raw):]
    if text.startswith(raw):
        return Closing(rest, len(rest))
    if grammars.closes(matcher, text, bound):
        return before
    pad = utf8_rest(raw)  # the token began a character: its last bytes come first
    tails = (rest, pad + rest, pad + text) if pad else (rest,)
    for tail in tails:
        if tail and grammars.closes(matcher, tail, bound):
            return Closing(tail, len(tail))
    return None
