"""Constrained decoding: a grammar per request, a matcher per sequence, one bitmask per tick.

The grammar engine is llguidance (an Earley parser over a lazily built lexer, from the Guidance
project; one of vLLM's structured-output backends). Chosen over xgrammar because it needs
nothing beside itself (xgrammar pulls in transformers and triton at run time), takes any
vocabulary as a list of token bytes (tether's byte tokenizer as well as Hugging Face ones),
builds a grammar in about a millisecond rather than precompiling masks for the whole vocabulary,
and answers one mask in microseconds; its matcher copies cheaply, which the budget below uses.

- `Grammars` compiles on threads of their own (llguidance drops the GIL while it builds), one
  for small specs and one for large ones, so that a compile a client made slow never holds up
  a cheap one; keeps compiled grammars (and refused ones) in a cache bounded by bytes, and gives
  each sequence a copy of one. A tick's masks are one batched call on a mask thread of its
  own, which drops the GIL too.
- Every matcher runs under PARSER_LIMITS: an ambiguous grammar's Earley rows grow with its
  output and each token's work with their square (a row of 2,000 items took 0.5 s a token), so
  a row is capped, and a request that reaches the cap is refused naming it.
- A sequence's `Constraint` owns its matcher: its row of the tick's bitmask, and the budget.
  Its mask is computed as soon as it has consumed a token, in the same breath: computed after
  a forward pass has run through the processor's caches, the same call took 10 to 20 times as
  long (measured here: 3 µs against 56 µs for a JSON schema's row of the byte vocabulary).
- The budget: an output that runs out of ``max_tokens`` half-written is invalid, so every
  constraint keeps the tokens it has left at least what closing it takes (a short way to an
  accepting state that daemon/engine/closing.py finds), plus one for the end of sequence. When
  a sampled token would break that, the constraint takes the closing instead, token by token.
  The first closing is searched on the compile thread and cached with the grammar; the ones
  searched on the tick, after a token that changes the structure, are bounded in steps and
  time, and one not found within its bound closes the output from where it was (still valid).
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import llguidance
import msgspec
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from daemon.engine.bitmask import Bitmask, fill_row
from daemon.engine.closing import MAX_CLOSING, Closing, SearchBound, Stopped, closing
from ipc.reasons import Reason
from ipc.records import Guide, GuideKind

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

log = logging.getLogger("tether.grammar")

# Compact JSON: whitespace is not the model's to choose (a random or weak model fills a budget
# with it, as vLLM's default does).
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ",",
                                     "key_separator": ":"}
DEFAULT_CACHE_BYTES = 64 << 20
MAX_SPELLED = 4096  # closings kept spelled in tokens (the same one is checked token after token)

# llguidance's limits on one matcher step (its defaults: 2,000 items in a row, 50,000 items a
# mask). The work of a token grows with the square of the row on an ambiguous grammar: measured
# here, 0.5 s a token at 2,000 items, 10 ms at 500. 500 items hold an object of about 120
# optional properties (each takes four); rows of unambiguous grammars stay small.
MAX_ITEMS_IN_ROW = 500
STEP_MAX_ITEMS = 10_000
# Symbols in one grammar (each %json schema is a grammar of its own; llguidance's default:
# 500,000). A row is built whole before its size is checked, with the GIL held: an object of
# 8,000 optional properties compiled for 8-36 s here and then held the GIL 0.3-0.6 s in each of
# its first steps, stalling the tick; under this bound it is refused in 0.15 s, and the largest
# object that compiles (about 2,400 properties) holds the GIL under 0.1 s a step.
MAX_GRAMMAR_SYMBOLS = 20_000
PARSER_LIMITS = llguidance.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW,
                                          step_max_items=STEP_MAX_ITEMS,
                                          max_grammar_size=MAX_GRAMMAR_SYMBOLS,
                                          verbose_errors=False)
# The first closing, searched once per grammar on its compile thread.
COMPILE_SEARCH_STEPS = 50_000
COMPILE_SEARCH_S = 0.5
# Specs up to this size compile on a thread of their own (one this size takes about 30 ms);
# larger ones, whose compile grows faster than their size, on another.
SMALL_SPEC_BYTES = 16 << 10
LIMIT_ADVICE = ("an ambiguous grammar, or an object of more than about 120 optional "
                "properties, reaches it")


class GrammarError(ValueError):
    """A guide that cannot be compiled, or whose output cannot be bounded; the message names
    what is wrong (and the limit, when one was reached)."""

    def __init__(self, message: str, reason: Reason = Reason.INVALID_GRAMMAR) -> None:
        super().__init__(message)
        self.reason = reason


def parser_limit_error(where: str, matcher: llguidance.LLMatcher | None = None) -> GrammarError:
    """A matcher stopped by PARSER_LIMITS (`where`: when), with llguidance's own words."""
    said = matcher.get_error().split("\n")[0] if matcher is not None else ""
    return GrammarError(f"the grammar reached the server's parser limits ({MAX_ITEMS_IN_ROW} "
                        f"parser items in a row, {STEP_MAX_ITEMS} a step; {LIMIT_ADVICE}) "
                        f"{where}" + (f": {said}" if said else ""), Reason.GRAMMAR_TOO_COMPLEX)


def no_closing_error(stopped: Stopped, bound: SearchBound) -> GrammarError:
    """No way to close an output was found from the grammar's start."""
    if stopped is Stopped.PARSER_LIMIT:
        return parser_limit_error("on the way to its shortest output")
    why = {Stopped.BOUND: f"within the server's search limit ({bound.steps} parser steps, "
                          f"{COMPILE_SEARCH_S:g} s)",
           Stopped.TOO_LONG: f"within the server's limit of {MAX_CLOSING} bytes",
           Stopped.DEAD_END: "(every way tried ends where no byte is allowed)"}[stopped]
    return GrammarError(f"no complete output of the grammar was found {why}",
                        Reason.GRAMMAR_TOO_COMPLEX)


class Vocabulary(Protocol):
    """What the grammar engine needs of a tokenizer (daemon/model/tokenizer.py)."""

    vocab_size: int
    eos_token_ids: list[int]

    def token_bytes(self, token_id: int) -> bytes: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    @property
    def tokenizer_json(self) -> str | None: ...


class _Wrapped:
    """A tokenizer as llguidance's TokenizerWrapper reads one."""

    def __init__(self, vocab: Vocabulary, special: Sequence[int], tokens: list[bytes]) -> None:
        self.tokens = tokens
        self.eos_token_id = vocab.eos_token_ids[0]
        self.bos_token_id = None
        self.special_token_ids = list(special)
        self._vocab = vocab

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._vocab.encode(text, add_special_tokens=False)


def _guidance_tokenizer(vocab: Vocabulary, special: Sequence[int],
                        tokens: list[bytes]) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary. A Hugging Face tokenizer is read from its own
    tokenizer.json (llguidance runs the same Rust tokenizers): through the wrapper, a
    SentencePiece tokenizer would spell a forced "{" as "▁{" and break the grammar."""
    serialized = vocab.tokenizer_json
    if serialized is None:
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(
            _Wrapped(vocab, special, tokens)))
    return llguidance.LLTokenizer(serialized, n_vocab=vocab.vocab_size,
                                  eos_token=list(vocab.eos_token_ids))


def grammar_text(guide: Guide) -> str:
    """The llguidance grammar of a guide; GrammarError when its spec is malformed."""
    try:
        if guide.kind is GuideKind.JSON_SCHEMA:
            schema = msgspec.json.decode(guide.spec)
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                                     defaults=_JSON_OPTIONS))
        if guide.kind is GuideKind.JSON_OBJECT:
            return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                     defaults=_JSON_OPTIONS))
        if guide.kind is GuideKind.REGEX:
            return str(llguidance.LLMatcher.grammar_from_regex(ascii_digits(guide.spec)))
        if guide.kind is GuideKind.CHOICE:
            choices = msgspec.json.decode(guide.spec, type=list[str])
            return str(llguidance.LLMatcher.grammar_from_regex(
                "|".join(_regex_literal(c) for c in choices)))
        # Lark as llguidance writes it, or llama.cpp's GBNF, turned into Lark.
        return str(llguidance.LLMatcher.grammar_from_lark(any_to_lark(guide.spec)))
    except (ValueError, msgspec.DecodeError, GbnfToLarkError, RecursionError) as e:
        raise GrammarError(str(e) or type(e).__name__) from None


def ascii_digits(regex: str) -> str:
    """The regex with `\\d` as [0-9] and `\\D` as [^0-9], as JSON Schema's ECMA-262 patterns
    and outlines read them: llguidance's `\\d` is any Unicode digit, so a random-weight answer
    to `\\d{4}-\\d\\d` once held U+10D43 (a Garay digit). Escapes (`\\\\d`) are kept."""
    out: list[str] = []
    i, first, in_class = 0, 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            if nxt == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif nxt == "D" and not in_class:
                out.append("[^0-9]")
            else:
                out.append(c + nxt)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class, first = True, len(out) + 1
        elif c == "]" and in_class and out[first:] not in ([], ["^"]):
            in_class = False  # (a "]" first in a class is one of its characters)
        out.append(c)
        i += 1
    return "".join(out)


def _regex_literal(text: str) -> str:
    return "".join(f"\\{c}" if c in r"\.^$|?*+()[]{}/" else c for c in text)


class Compiled(NamedTuple):
    """A compiled guide: its matcher at the start, and the closing from there (what the
    shortest output takes, as far as the search finds)."""

    matcher: llguidance.LLMatcher
    start: Closing

    def copy(self) -> Compiled:
        """One to advance (the closing is immutable; the matcher is not)."""
        return self._replace(matcher=self.matcher.deep_copy())


@dataclass(slots=True)
class _Entry:
    compiled: Compiled | None
    error: GrammarError | None  # a guide refused is refused again, without a compile
    size: int


class Grammars:
    """Compiled grammars for one vocabulary: compiled off the tick thread with their first
    closing, cached by bytes."""

    def __init__(self, vocab: Vocabulary, special_token_ids: Sequence[int] = (), *,
                 cache_bytes: int = DEFAULT_CACHE_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        tokens = [vocab.token_bytes(i) for i in range(vocab.vocab_size)]
        self.token_bytes = tokens
        self.tokenizer = _guidance_tokenizer(vocab, special_token_ids, tokens)
        self.vocab_size = vocab.vocab_size
        self.eos_token_ids = list(vocab.eos_token_ids)
        self.eos_ids = frozenset(self.eos_token_ids)
        # A token per byte where the vocabulary has one: what a closing is spelled in.
        self.byte_tokens: dict[int, int] = {}
        for token_id, raw in enumerate(tokens):
            if len(raw) == 1 and token_id not in special_token_ids:
                self.byte_tokens.setdefault(raw[0], token_id)
        # The token of each spelling (speculative drafts learn how an output splits them).
        self.token_ids = {raw: token_id for token_id, raw in enumerate(tokens)
                          if raw and token_id not in special_token_ids}
        self.mask_width = (self.vocab_size + 31) // 32
        self.zero_mask = array("i", bytes(4 * self.mask_width))
        self._spelled: dict[bytes, list[int]] = {}  # closings in byte tokens, as checked
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[Guide, _Entry] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        # Two lanes: a slow compile (a large spec) never holds up a small one.
        self._small = ThreadPoolExecutor(1, thread_name_prefix="tether-grammar")
        self._large = ThreadPoolExecutor(1, thread_name_prefix="tether-grammar-large")
        # The tick's masks: one call for the batch, which lets go of the GIL while it runs.
        self._mask_executor = llguidance.LLExecutor(1)
        self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="tether-masks")
        self._clock = clock
        self.num_hits = 0
        self.num_misses = 0
        self.compile_obs: list[float] = []  # seconds per compile since the last Stats

    @property
    def num_cached_bytes(self) -> int:
        return self._cached_bytes

    def compile(self, guide: Guide) -> Future[Compiled]:
        """A future compiled guide, at once when it is cached; its exception is a GrammarError
        naming what is wrong."""
        with self._lock:
            entry = self._cache.get(guide)
            if entry is not None:
                self._cache.move_to_end(guide)
                self.num_hits += 1
                done: Future[Compiled] = Future()
                if entry.compiled is not None:
                    done.set_result(entry.compiled.copy())
                else:
                    assert entry.error is not None
                    done.set_exception(entry.error)
                return done
            self.num_misses += 1
        lane = self._small if len(guide.spec) <= SMALL_SPEC_BYTES else self._large
        return lane.submit(self._build, guide)

    def _build(self, guide: Guide) -> Compiled:
        t0 = self._clock()
        try:
            text = grammar_text(guide)
            compiled = self._compiled(text)
        except GrammarError as e:
            self._keep(guide, _Entry(None, e, len(guide.spec)), t0)
            raise
        self._keep(guide, _Entry(compiled.copy(), None,
                                 len(text) + len(guide.spec)), t0)
        return compiled

    def _compiled(self, grammar: str) -> Compiled:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, limits=PARSER_LIMITS,
                                       log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        bound = SearchBound.within(COMPILE_SEARCH_STEPS, COMPILE_SEARCH_S, self._clock)
        start = self.exact_closing(matcher, bound)
        if isinstance(start, Stopped):
            raise no_closing_error(start, bound)
        return Compiled(matcher, start)

    def _keep(self, guide: Guide, entry: _Entry, t0: float) -> None:
        with self._lock:
            self.compile_obs.append(self._clock() - t0)
            if entry.size > self.cache_bytes or guide in self._cache:
                return
            self._cache[guide] = entry
            self._cached_bytes += entry.size
            while self._cached_bytes > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.size

    def take_compile_obs(self) -> list[float]:
        with self._lock:
            obs, self.compile_obs = self.compile_obs, []
        return obs

    def close(self) -> None:
        for pool in (self._small, self._large, self._mask_thread):
            pool.shutdown(wait=False, cancel_futures=True)

    # --- closings -------------------------------------------------------------------------------

    def exact_closing(self, matcher: llguidance.LLMatcher,
                      bound: SearchBound) -> Closing | Stopped:
        """The closing `closing` finds from the matcher's state within `bound`, its tokens
        counted; or why none was found."""
        text = closing(matcher, self.byte_tokens, bound)
        if isinstance(text, Stopped):
            return text
        return Closing(text, len(self.tokenizer.tokenize_bytes(text)) if text else 0)

    def closes(self, matcher: llguidance.LLMatcher, text: bytes, bound: SearchBound) -> bool:
        """Whether `text` still takes the matcher's state to the end (one call, nothing moved);
        False too when `bound` cannot pay for the check."""
        tokens = self._spelled.get(text)
        if tokens is None:
            if len(self._spelled) >= MAX_SPELLED:
                self._spelled.clear()
            tokens = [self.byte_tokens.get(b, -1) for b in text]
            tokens = self._spelled[text] = [] if -1 in tokens else [*tokens, self.eos_token_ids[0]]
        return (bool(tokens) and bound.spend(len(tokens))
                and matcher.validate_tokens(tokens) == len(tokens))

    # --- the tick's masks -----------------------------------------------------------------------

    def new_bitmask(self, rows: int) -> Bitmask:
        return Bitmask(rows, self.mask_width)

    def fill_masks(self, rows: list[tuple[llguidance.LLMatcher, int, list[int]]],
                   bitmask: Bitmask) -> Future[None]:
        """`fill_masks_now` on the mask thread, each kind of row in one batched call."""
        return self._mask_thread.submit(self.fill_masks_now, rows, bitmask, True)

    def fill_masks_now(self, rows: list[tuple[llguidance.LLMatcher, int, list[int]]],
                       bitmask: Bitmask, batched: bool = False) -> None:
        """Each matcher's allowed tokens into its row of `bitmask`; with drafts, a row after it
        for each, the allowed tokens after the drafts before it (llguidance advances the
        matcher through them and rolls it back). Both calls let go of the GIL."""
        plain = [(matcher, row) for matcher, row, drafts in rows if not drafts]
        drafted = [entry for entry in rows if entry[2]]
        pointer, size, num_rows = bitmask.address(0), bitmask.width * 4, bitmask.tensor.shape[0]
        if batched and plain:
            self._mask_executor.unsafe_compute_mask_ptr(plain, pointer, size, num_rows)
        else:
            for matcher, row in plain:
                fill_row(matcher, bitmask, row)
        if drafted:
            self._mask_executor.unsafe_compute_mask_ptr_with_draft_token(drafted, pointer, size,
                                                                        num_rows)
