"""Constrained decoding: a grammar per request, a matcher per sequence, one bitmask per tick.

The grammar engine is llguidance (an Earley parser over a lazily built lexer, from the Guidance
project; one of vLLM's structured-output backends). Chosen over xgrammar because it needs
nothing beside itself (xgrammar pulls in transformers and triton at run time), takes any
vocabulary as a list of token bytes (tether's byte tokenizer as well as Hugging Face ones),
builds a grammar in about a millisecond rather than precompiling masks for the whole vocabulary,
and answers one mask in microseconds; its matcher copies cheaply, which the budget below uses.

- `Grammars` compiles on a thread of its own (llguidance drops the GIL while it builds), keeps
  compiled grammars in a cache bounded by bytes, and gives each sequence a copy of one. A
  tick's masks are one batched call on a mask thread of its own, which drops the GIL too.
- A sequence's `Constraint` owns its matcher: its row of the tick's bitmask, and the budget.
  Its mask is computed as soon as it has consumed a token, in the same breath: computed after
  a forward pass has run through the processor's caches, the same call took 10 to 20 times as
  long (measured here: 3 µs against 56 µs for a JSON schema's row of the byte vocabulary).
- The budget: an output that runs out of ``max_tokens`` half-written is invalid, so every
  constraint keeps the tokens it has left at least what closing it takes (a short way to an
  accepting state that daemon/engine/closing.py finds), plus one for the end of sequence. When
  a sampled token would break that, the constraint takes the closing instead, token by token.
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
from typing import TYPE_CHECKING, Protocol

import llguidance
import msgspec
from llguidance.gbnf_to_lark import any_to_lark

from daemon.engine.bitmask import Bitmask, bit, fill_row
from daemon.engine.closing import Closing, closing, utf8_rest
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


class GrammarError(ValueError):
    """A guide that cannot be compiled; the message names what is wrong."""


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
            return str(llguidance.LLMatcher.grammar_from_regex(guide.spec))
        if guide.kind is GuideKind.CHOICE:
            choices = msgspec.json.decode(guide.spec, type=list[str])
            return str(llguidance.LLMatcher.grammar_from_regex(
                "|".join(_regex_literal(c) for c in choices)))
        # Lark as llguidance writes it, or llama.cpp's GBNF, turned into Lark.
        return str(llguidance.LLMatcher.grammar_from_lark(any_to_lark(guide.spec)))
    except (ValueError, msgspec.DecodeError) as e:
        raise GrammarError(str(e)) from None


def _regex_literal(text: str) -> str:
    return "".join(f"\\{c}" if c in r"\.^$|?*+()[]{}/" else c for c in text)


@dataclass(slots=True)
class _Entry:
    matcher: llguidance.LLMatcher
    size: int


class Grammars:
    """Compiled grammars for one vocabulary: compiled off the tick thread, cached by bytes."""

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
        self.mask_width = (self.vocab_size + 31) // 32
        self.zero_mask = array("i", bytes(4 * self.mask_width))
        self._spelled: dict[bytes, list[int]] = {}  # closings in byte tokens, as checked
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[Guide, _Entry] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tether-grammar")
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

    def compile(self, guide: Guide) -> Future[llguidance.LLMatcher]:
        """A future matcher for `guide`, at once when it is cached; its exception is a
        GrammarError naming what is wrong."""
        with self._lock:
            entry = self._cache.get(guide)
            if entry is not None:
                self._cache.move_to_end(guide)
                self.num_hits += 1
                done: Future[llguidance.LLMatcher] = Future()
                done.set_result(entry.matcher.deep_copy())
                return done
            self.num_misses += 1
        return self._pool.submit(self._build, guide)

    def _build(self, guide: Guide) -> llguidance.LLMatcher:
        t0 = self._clock()
        grammar = grammar_text(guide)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer)
        if failed:
            raise GrammarError(messages[0] if messages else "invalid grammar")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        size = len(grammar) + len(guide.spec)
        with self._lock:
            self.compile_obs.append(self._clock() - t0)
            if size <= self.cache_bytes and guide not in self._cache:
                self._cache[guide] = _Entry(matcher.deep_copy(), size)
                self._cached_bytes += size
                while self._cached_bytes > self.cache_bytes:
                    _, old = self._cache.popitem(last=False)
                    self._cached_bytes -= old.size
        return matcher

    def take_compile_obs(self) -> list[float]:
        with self._lock:
            obs, self.compile_obs = self.compile_obs, []
        return obs

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._mask_thread.shutdown(wait=False, cancel_futures=True)

    # --- closings -------------------------------------------------------------------------------

    def exact_closing(self, matcher: llguidance.LLMatcher) -> Closing | None:
        """The closing `closing` finds from the matcher's state, its tokens counted; None when
        none is found."""
        text = closing(matcher, self.byte_tokens)
        if text is None:
            return None
        return Closing(text, len(self.tokenizer.tokenize_bytes(text)) if text else 0)

    def closes(self, matcher: llguidance.LLMatcher, text: bytes) -> bool:
        """Whether `text` still takes the matcher's state to the end (one call, nothing moved)."""
        tokens = self._spelled.get(text)
        if tokens is None:
            if len(self._spelled) >= MAX_SPELLED:
                self._spelled.clear()
            tokens = [self.byte_tokens.get(b, -1) for b in text]
            tokens = self._spelled[text] = [] if -1 in tokens else [*tokens, self.eos_token_ids[0]]
        return bool(tokens) and matcher.validate_tokens(tokens) == len(tokens)

    # --- the tick's masks -----------------------------------------------------------------------

    def new_bitmask(self, rows: int) -> Bitmask:
        return Bitmask(rows, self.mask_width)

    def fill_masks(self, rows: list[tuple[llguidance.LLMatcher, int]],
                   bitmask: Bitmask) -> Future[None]:
        """Each matcher's allowed tokens into its row of `bitmask`, on the mask thread."""
        return self._mask_thread.submit(self._mask_executor.unsafe_compute_mask_ptr, rows,
                                        bitmask.address(0), bitmask.width * 4,
                                        bitmask.tensor.shape[0])


class Constraint:
    """One sequence's matcher and its budget; advanced once per sampled token.

    The constraint always holds a closing that is valid from the matcher's state and fits in
    the tokens left. Each sampled token is checked against it at the price of one call: when
    the token spells the closing's first bytes the rest still closes; when the closing still
    takes the new state to the end (a character inside a string, a digit) it is kept; only a
    token that changes the structure (a key that opens a required object, an array item) makes
    the constraint search for a closing again. A token that leaves no room for one is taken
    back, and the output closes from where it was."""

    __slots__ = ("_closing", "_forced", "_grammars", "_mask", "_mask_ready", "matcher")

    def __init__(self, grammars: Grammars, matcher: llguidance.LLMatcher,
                 start: Closing | None = None) -> None:
        self._grammars = grammars
        self.matcher = matcher
        self._forced: list[int] = []  # the closing being spelled, token by token
        self._mask = array("i", bytes(4 * grammars.mask_width))  # from the matcher's state
        self._mask_ready = False
        # From the matcher's state (`start`: the template's, shared by a request's sequences).
        self._closing = start if start is not None else grammars.exact_closing(matcher)

    @property
    def forced(self) -> bool:
        return bool(self._forced)

    def fill(self, bitmask: Bitmask, row: int) -> None:
        """Writes this tick's allowed tokens into row `row` of `bitmask`."""
        if not self.fill_known(bitmask, row):
            fill_row(self.matcher, bitmask, row)

    def fill_known(self, bitmask: Bitmask, row: int) -> bool:
        """`fill` when the allowed tokens are known without the matcher (a forced token, or
        the mask computed when the last token was consumed); False, and nothing written,
        when they are not."""
        width = bitmask.width
        at = row * width
        if self._forced:
            token = self._forced[0]
            bitmask.words[at:at + width] = self._grammars.zero_mask
            bitmask.words[at + (token >> 5)] = bit(token & 31)
            return True
        if not self._mask_ready:
            return False
        bitmask.words[at:at + width] = self._mask
        return True

    def compute_mask(self) -> None:
        """The allowed tokens from the matcher's state, computed now for the next tick (see
        the module's docstring for why now)."""
        if self._forced or self.matcher.is_stopped():
            return
        self.matcher.unsafe_compute_mask_ptr(int(self._mask.buffer_info()[0]),
                                             4 * len(self._mask))
        self._mask_ready = True

    def feasible(self, left: int) -> bool:
        """Whether an output can still be closed in `left` tokens (a request whose budget
        cannot hold the shortest valid output is refused up front)."""
        return self._closing is not None and self._closing.cost + 1 <= left

    def accept(self, token: int, left: int, allowed: bool | None = None) -> int:
        """The token to emit for `token` sampled with `left` tokens still allowed (this one
        included; `allowed`: whether this tick's mask let it through, when known): the sampled
        token, or the next of the closing when the sampled one would leave too few to close
        the output. The matcher has consumed what it returns."""
        self._mask_ready = False
        if self._forced:
            forced = self._forced.pop(0)
            self.matcher.consume_token(forced)
            return forced
        if allowed is None:
            allowed = self.matcher.validate_tokens([token]) == 1
        if not allowed:
            # Only when every allowed token had no chance under the model (its logits all -inf
            # there): close instead.
            return self._close()
        if token in self._grammars.eos_ids:
            self.matcher.consume_token(token)
            return token
        self.matcher.consume_token(token)
        after = self._follow(token, left - 1)
        if after is not None:
            self._closing = after
            return token
        # This token leaves no room to close: take it back and close from where we were.
        self.matcher.rollback(1)
        return self._close()

    def _follow(self, token: int, room: int) -> Closing | None:
        """A closing from the state after `token` that fits in `room` tokens (an end of sequence
        included), or None."""
        grammars, before = self._grammars, self._closing
        if before is not None:
            kept = _kept(grammars, self.matcher, before, grammars.token_bytes[token])
            if kept is not None and kept.cost + 1 <= room:
                return kept
        found = grammars.exact_closing(self.matcher)  # a new structure, or a bound too loose
        return found if found is not None and found.cost + 1 <= room else None

    def _close(self) -> int:
        """The first token of the closing from here (an accepting state closes with the end of
        sequence); the rest are forced on the next ticks."""
        grammars = self._grammars
        text = self._closing.text if self._closing is not None else b""
        tokens = list(grammars.tokenizer.tokenize_bytes(text)) if text else []
        tokens.append(grammars.eos_token_ids[0])
        self._forced = tokens[1:]
        self.matcher.consume_token(tokens[0])
        return tokens[0]


def _kept(grammars: Grammars, matcher: llguidance.LLMatcher, before: Closing,
          raw: bytes) -> Closing | None:
    """The closing from before a token of bytes `raw`, as it still closes from after it: what
    the token did not spell of it (the token was its start, or took the place of its first
    bytes: a character of a fixed-length string, a digit), or all of it (a character of a free
    string); None when the token changed what closing takes."""
    text = before.text
    rest = text[len(raw):]
    if text.startswith(raw):
        return Closing(rest, len(rest))
    if grammars.closes(matcher, text):
        return before
    pad = utf8_rest(raw)  # the token began a character: its last bytes come first
    tails = (rest, pad + rest, pad + text) if pad else (rest,)
    for tail in tails:
        if tail and grammars.closes(matcher, tail):
            return Closing(tail, len(tail))
    return None
