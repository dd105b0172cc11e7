"""Turning a Submit's prompts (rendered by daemon/prompts.py) into sequences: check the limits,
or reject it.

Every rejection is an `Error` record naming the request field and the limit, so the proxy can
answer the client without knowing anything about tokens.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from daemon.engine.block_manager import BlockManager
from daemon.engine.echo import make_echoes
from daemon.engine.logits_processors import bad_word_ids
from daemon.engine.output import Detokenizer, Output
from daemon.engine.sampler import seed_for
from daemon.engine.sequence import Sequence
from daemon.engine.stops import StopMatcher
from daemon.model.tokenizer import Tokenizer
from daemon.prompts import check_ids, too_long
from daemon.rejected import Rejected
from ipc.reasons import Reason
from ipc.records import AbortCause, RequestKind, Submit

Built = tuple[list[Sequence], list[Output]]  # a request's sequences, and their outputs


def check_sequences(submit: Submit, max_num_seqs: int, max_seqs_per_request: int | None) -> None:
    """A prompt's n siblings run at once, so n fits in a batch; and however its sequences are
    made up, one request has at most `max_seqs_per_request` (the proxy checks it first)."""
    if submit.n > max_num_seqs:
        raise Rejected(f"n ({submit.n}) exceeds the server's limit of {max_num_seqs}",
                       param="n")
    count = submit.num_sequences
    if max_seqs_per_request is not None and count > max_seqs_per_request:
        made_of = (f"{len(submit.prompts)} prompts x n={submit.n}"
                   if submit.kind is RequestKind.COMPLETION else f"n={submit.n}")
        raise Rejected(f"the request asks for {count} sequences ({made_of}), more than the "
                       f"server's limit of {max_seqs_per_request} per request",
                       param="n" if submit.n > 1 else "prompt", reason=Reason.TOO_MANY_SEQUENCES)


def check_limits(submit: Submit, prompts: list[list[int]], max_model_len: int,
                 block_manager: BlockManager, vocab_size: int) -> None:
    params = submit.sampling
    check_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    check_ids(list(params.logit_bias), vocab_size, "logit_bias")
    param = "max_output_tokens" if submit.kind is RequestKind.RESPONSE else "max_tokens"
    longest = max(len(p) for p in prompts)
    if params.max_tokens is None:  # the rest of the context: only the prompt can be too long
        _check_room(submit, longest, max_model_len, block_manager)
        return
    max_tokens = params.max_tokens
    if params.max_tokens_ceiling and max_tokens > output_room(longest, submit.n, max_model_len,
                                                              block_manager):
        _check_room(submit, longest, max_model_len, block_manager)  # the room is the ceiling
        return
    if longest + max_tokens > max_model_len:
        room = max_model_len - longest
        if room > 0:
            raise Rejected(
                f"this model's maximum context length is {max_model_len} tokens, but the prompt "
                f"has {longest} tokens and {param} is {max_tokens} ({longest + max_tokens} in "
                f"total); reduce {param} to at most {room}", param=param,
                reason=Reason.CONTEXT_LENGTH_EXCEEDED)
        part, what, advice = too_long(submit, max_model_len)
        raise Rejected(
            f"this model's maximum context length is {max_model_len} tokens, but {what} has "
            f"{longest} tokens, with no room left for the output; {advice}", param=part,
            reason=Reason.CONTEXT_LENGTH_EXCEEDED)
    # One sequence and its forked siblings' copied blocks must fit, or it could never run.
    need = (block_manager.num_blocks_for(longest + max_tokens)
            + block_manager.fork_cost(longest) * (submit.n - 1))
    if need > block_manager.num_total:
        cap = block_manager.num_total * block_manager.block_size
        raise Rejected(f"the prompt ({longest} tokens) plus {param} ({max_tokens}) with n="
                       f"{submit.n} exceeds the KV cache capacity of {cap} tokens",
                       param=param)


def _check_room(submit: Submit, longest: int, max_model_len: int,
                block_manager: BlockManager) -> None:
    """An omitted max_tokens: the longest prompt must leave room for at least one token, and
    min_tokens for as many."""
    room = output_room(longest, submit.n, max_model_len, block_manager)
    if room >= max(1, submit.sampling.min_tokens):
        return
    if room >= 1:
        raise Rejected(f"min_tokens ({submit.sampling.min_tokens}) is more than the room the "
                       f"prompt ({longest} tokens) leaves for the output ({room} tokens)",
                       param="min_tokens", reason=Reason.CONTEXT_LENGTH_EXCEEDED)
    part, what, advice = too_long(submit, max_model_len)
    if longest < max_model_len:
        cap = block_manager.num_total * block_manager.block_size
        raise Rejected(f"{what} ({longest} tokens) with n={submit.n} leaves no room for the "
                       f"output in the KV cache capacity of {cap} tokens; {advice}", param=part)
    raise Rejected(
        f"this model's maximum context length is {max_model_len} tokens, but {what} has "
        f"{longest} tokens, with no room left for the output; {advice}", param=part,
        reason=Reason.CONTEXT_LENGTH_EXCEEDED)


def output_room(prompt_len: int, n: int, max_model_len: int, block_manager: BlockManager) -> int:
    """Tokens a prompt leaves for its output: the rest of the context, or what the KV cache
    holds for one of its n sequences (with its siblings' copies of the partial block), if less.
    Past that a sequence could never be scheduled alone."""
    bm = block_manager
    blocks = bm.num_total - bm.fork_cost(prompt_len) * (n - 1)
    return min(max_model_len, blocks * bm.block_size) - prompt_len


def build_sequences(submit: Submit, prompts: list[list[int]],
                    make_detok: Callable[[list[int]], Detokenizer], tokenizer: Tokenizer,
                    max_model_len: int, block_manager: BlockManager,
                    ) -> Built:
    """All sequences in index order, and their outputs; sample 0 of each prompt carries its
    siblings to fork. An omitted max_tokens becomes each prompt's room for the output
    (`output_room`), as does a ceiling above it."""
    params = submit.sampling
    bad_words = bad_word_ids(params.bad_words,
                             lambda text: tokenizer.encode(text, add_special_tokens=False))
    seqs: list[Sequence] = []
    outputs: list[Output] = []
    for p, (ids, echo) in enumerate(zip(prompts, make_echoes(submit, prompts, tokenizer),
                                        strict=True)):
        room = output_room(len(ids), submit.n, max_model_len, block_manager)
        max_tokens = room if params.max_tokens is None else (
            min(params.max_tokens, room) if params.max_tokens_ceiling else params.max_tokens)
        gathered = echo if echo is not None and echo.num_logprobs is not None else None
        group = [
            Sequence(rid=submit.rid, index=p * submit.n + s, token_ids=list(ids), params=params,
                     seed=None if params.seed is None else seed_for(params.seed, s),
                     max_tokens=max_tokens, bad_words=bad_words, prompt_logprobs=gathered)
            for s in range(submit.n)
        ]
        group[0].fork_children = group[1:]
        seqs.extend(group)
        outputs += [Output(make_detok(ids), StopMatcher(params.stop), echo)
                    for _ in range(submit.n)]
    return seqs, outputs


class Tombstones:
    """Rids aborted before their Submit arrived: bounded in number and in age, and each used
    once (the Submit it was waiting for takes it away)."""

    def __init__(self, max_size: int = 65536, ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_size = max_size
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, AbortCause, float | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, rid: str, cause: AbortCause, t_disconnect: float | None = None) -> None:
        self._entries[rid] = (self._clock() + self.ttl_s, cause, t_disconnect)
        self._entries.move_to_end(rid)
        self._expire()

    def pop(self, rid: str) -> tuple[AbortCause, float | None] | None:
        """The abort waiting for this rid (its cause and disconnect time), removed."""
        self._expire()
        entry = self._entries.pop(rid, None)
        return None if entry is None else (entry[1], entry[2])

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            rid, (expiry, _, _) = next(iter(self._entries.items()))
            if expiry > now and len(self._entries) <= self.max_size:
                return
            del self._entries[rid]
