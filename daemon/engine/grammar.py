"""Constrained decoding: a grammar per request, a matcher per sequence, one bitmask per tick.

The grammar engine is llguidance (an Earley parser over a lazily built lexer, from the Guidance
project; one of vLLM's structured-output backends). Chosen over xgrammar because it needs
nothing beside itself (xgrammar pulls in transformers and triton at run time), takes any
vocabulary as a list of token bytes (tether's byte tokenizer as well as Hugging Face ones),
builds a grammar in about a millisecond rather than precompiling masks for the whole vocabulary,
and answers one mask in microseconds; its matcher copies cheaply, which the budget below uses.

- `Grammars` compiles on a thread of its own (llguidance drops the GIL while it builds), keeps
  compiled grammars in a cache bounded by bytes, and gives each sequence a copy of one.
- A sequence's `Constraint` owns its matcher: its row of the tick's bitmask, and the budget.
- The budget: an output that runs out of ``max_tokens`` half-written is invalid, so every
  constraint keeps the tokens it has left at least what closing it takes (the shortest way to
  an accepting state that `closing` finds, tokenized), plus one for the end of sequence. When a
  sampled token would break that, the constraint takes the closing instead, token by token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import llguidance
import msgspec
import torch
from llguidance.gbnf_to_lark import any_to_lark

from ipc.records import Guide, GuideKind

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

log = logging.getLogger("tether.grammar")

# Compact JSON: whitespace is not the model's to choose (a random or weak model fills a budget
# with it, as vLLM's default does).
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ",",
                                     "key_separator": ":"}
DEFAULT_CACHE_BYTES = 64 << 20
# How often the budget is looked at while it is far (tokens), and what "near" means: a closing
# can grow between two looks (a token that opens a structure), so near is generous.
CHECK_EVERY = 8
NEAR = 64
# The closing search gives up beyond this many bytes (the budget then cannot be kept).
MAX_CLOSING = 4096
_PREFERRED = [ord(c) for c in '}]0"[{ntf,:']  # bytes that end a structure soonest, first


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
        self.tokenizer = _guidance_tokenizer(vocab, special_token_ids, tokens)
        self.vocab_size = vocab.vocab_size
        self.eos_token_ids = list(vocab.eos_token_ids)
        # A token per byte where the vocabulary has one: what a closing is spelled in.
        self.byte_tokens: dict[int, int] = {}
        for token_id, raw in enumerate(tokens):
            if len(raw) == 1 and token_id not in special_token_ids:
                self.byte_tokens.setdefault(raw[0], token_id)
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[Guide, _Entry] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tether-grammar")
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

    # --- the tick's masks -----------------------------------------------------------------------

    def new_bitmask(self, rows: int) -> torch.Tensor:
        return torch.empty((rows, (self.vocab_size + 31) // 32), dtype=torch.int32)


class Constraint:
    """One sequence's matcher and its budget; advanced once per sampled token."""

    __slots__ = ("_forced", "_grammars", "_last_check", "matcher")

    def __init__(self, grammars: Grammars, matcher: llguidance.LLMatcher) -> None:
        self._grammars = grammars
        self.matcher = matcher
        self._forced: list[int] = []  # the closing being spelled, token by token
        self._last_check: tuple[int, int] | None = None  # (tokens left then, closing then)

    @property
    def forced(self) -> bool:
        return bool(self._forced)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes this tick's allowed tokens into `bitmask[row]` (a CPU int32 tensor)."""
        target = bitmask[row]
        if self._forced:
            target.zero_()
            token = self._forced[0]
            target[token // 32] = _bit(token % 32)
            return
        self.matcher.unsafe_compute_mask_ptr(target.data_ptr(),
                                             target.numel() * target.element_size())

    def feasible(self, left: int) -> bool:
        """Whether an output can still be closed in `left` tokens (a request whose budget
        cannot hold the shortest valid output is refused up front)."""
        closing = self._closing_tokens(self.matcher)
        return closing is not None and len(closing) + 1 <= left

    def accept(self, token: int, left: int) -> int:
        """The token to emit for `token` sampled with `left` tokens still allowed (this one
        included): the sampled token, or the next of the closing when the sampled one would
        leave too few to close the output. The matcher has consumed what it returns."""
        if self._forced:
            forced = self._forced.pop(0)
            self.matcher.consume_token(forced)
            return forced
        if self.matcher.validate_tokens([token]) != 1:
            # Only when every allowed token had no chance under the model (its logits all -inf
            # there): close instead.
            return self._close(token)
        if token in self._grammars.eos_token_ids or not self._due(left):
            self.matcher.consume_token(token)
            return token
        self.matcher.consume_token(token)
        after = self._closing_tokens(self.matcher)
        if after is not None and len(after) + 1 <= left - 1:
            self._last_check = (left - 1, len(after))
            return token
        # This token leaves no room to close: take it back and close from where we were.
        self.matcher.rollback(1)
        return self._close(token)

    def _close(self, token: int) -> int:
        """The first token of the closing from here (an accepting state closes with the end of
        sequence); the rest are forced on the next ticks."""
        tokens = self._closing_tokens(self.matcher)
        if tokens is None:  # no closing found: nothing can keep this output within its budget
            self.matcher.consume_token(token)
            return token
        tokens = tokens or [self._grammars.eos_token_ids[0]]
        self._forced = tokens[1:]
        self.matcher.consume_token(tokens[0])
        return tokens[0]

    def _due(self, left: int) -> bool:
        """Whether to look at the budget now: at every token near it, every CHECK_EVERY tokens
        while the tokens left are far more than the last closing took."""
        last = self._last_check
        if last is None:
            return True
        then_left, closing = last
        return left - 1 <= 2 * closing + NEAR or then_left - (left - 1) >= CHECK_EVERY

    def _closing_tokens(self, matcher: llguidance.LLMatcher) -> list[int] | None:
        text = closing(matcher, self._grammars.byte_tokens)
        if text is None:
            return None
        if not text:
            return []
        return list(self._grammars.tokenizer.tokenize_bytes(text))


def closing(matcher: llguidance.LLMatcher, byte_tokens: dict[int, int]) -> bytes | None:
    """A short string of bytes that takes `matcher` to an accepting state (without touching it),
    or None when none is found within MAX_CLOSING bytes.

    Greedy over single bytes: the forced bytes first, then, where the grammar allows a wide set
    (free text), the byte that closes a string, and elsewhere the bytes that end a structure
    soonest (close, a one-character value, an empty container) before anything else."""
    m = matcher.deep_copy()
    out = bytearray()
    while len(out) < MAX_CLOSING:
        if m.is_accepting():
            return bytes(out)
        forced = m.compute_ff_bytes()
        if forced:
            if not _consume_bytes(m, forced, byte_tokens):
                return None
            out += forced
            continue
        choice = _next_byte(m, byte_tokens)
        if choice is None:
            return None
        m.consume_token(byte_tokens[choice])
        out.append(choice)
    return None


def _consume_bytes(m: llguidance.LLMatcher, data: bytes, byte_tokens: dict[int, int]) -> bool:
    for b in data:
        token = byte_tokens.get(b)
        if token is None or not m.consume_token(token):
            return False
    return True


def _allowed(m: llguidance.LLMatcher, byte: int, byte_tokens: dict[int, int]) -> bool:
    token = byte_tokens.get(byte)
    return token is not None and m.validate_tokens([token]) == 1


_PROBES = [ord(c) for c in "aQz7~ "]  # all allowed: free text (inside a string, a regex class)


def _next_byte(m: llguidance.LLMatcher, byte_tokens: dict[int, int]) -> int | None:
    if all(_allowed(m, b, byte_tokens) for b in _PROBES):
        order = [ord('"'), *_PREFERRED]
    else:
        order = _PREFERRED
    for b in order:
        if _allowed(m, b, byte_tokens):
            return b
    for b in range(256):
        if _allowed(m, b, byte_tokens):
            return b
    return None


def _bit(index: int) -> int:
    """Bit `index` of an int32 word, as a signed value."""
    return -(1 << 31) if index == 31 else 1 << index


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Forbids, in place, every token a row's bitmask does not allow (`rows[i]` of `logits`
    takes `bitmask[i]`); the mask crosses to the logits' device in one copy."""
    if not rows:
        return
    vocab = logits.shape[-1]
    words = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    if allowed.shape[1] < vocab:  # a head padded past the tokenizer: those ids never allowed
        allowed = torch.cat([allowed, allowed.new_zeros((len(rows), vocab - allowed.shape[1]))],
                            dim=1)
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index)
    logits.index_copy_(0, index, sub.masked_fill(~allowed, float("-inf")))
