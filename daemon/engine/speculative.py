"""Speculative decoding by prompt lookup (n-gram): drafts from a sequence's own tokens, verified
in one forward pass.

A drafted sequence's decode is `[last token] + drafts`, one chunk whose every position gives a
logits row; a draft is accepted while it equals what the sequence samples at the row before it,
and the first sampled id that differs (or the one after the last draft) comes free.

That is Leviathan et al.'s rejection sampling for a draft that is one token for certain (q is a
point mass): accept draft t with probability min(1, p(t)/q(t)) = p(t), and on rejection draw from
p with t taken out, renormalised. A draw x from p itself does both at once: x = t with
probability p(t), and any other y with probability p(y) = (1 - p(t)) * p(y) / (1 - p(t)). So
each row is sampled as without speculation (temperature, top-k/p, min-p, bias, its seed's
generator), and the output is distributed exactly as without; greedy rows take the argmax, so
greedy output is the same token for token.

With a grammar (structured outputs, forced tool calls), a sequence's drafts are first the
bytes its grammar forces from here, as the tokenizer spells them (a schema's keys and
punctuation; or the rest of a closing being spelled), then the n-gram's, cut at the first the
grammar refuses and before an end of sequence (`Constraint.draft`; nothing is consumed). Each
row of its chunk is sampled under the mask after the drafts before it (`Guidance.start_masks`:
llguidance advances the matcher through them and rolls it back, on the mask thread when that
pays), so each row is sampled as one-token decoding would have; the update phase then hands
the kept tokens to the constraint one by one as always, and one it replaces with its closing's
keeps only the drafts before it (`Engine.update`). A tick's grammar work for drafts is bounded
in matcher steps and time (`Guidance.draft_bound`); past the bound a sequence drafts nothing.

Drafts live in one step's `Batch` only: no sequence or session keeps any, so an abort or a
preemption between steps leaves nothing speculative behind (a sequence keeps only its back-off
counters, freed with it).

Torch-free: `tether/settings.py` parses the configuration with `parse_config`.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from daemon.engine.sequence import Sequence

if TYPE_CHECKING:
    from daemon.engine.closing import SearchBound

_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
           "disable_by_batch_size")
MAX_SPECULATIVE_TOKENS = 64
MAX_DRAFT_WAIT = 32  # steps a sequence whose drafts keep failing goes without, at most
# Occurrences of a suffix one search looks at (those across two ids' bytes, or too near the end,
# are passed over): ids a client chooses can make every period of the context such a match,
# and a search is a Python step each.
MAX_LOOKS = 64


@dataclass(frozen=True, slots=True)
class NgramConfig:
    """vLLM's `--speculative-config` for method "ngram"."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    # No drafts in a step with more decodes than this (where the forward pass is bound by
    # compute, not by reading the weights, verifying drafts costs more than it saves).
    disable_by_batch_size: int | None = None


def parse_config(text: str) -> NgramConfig | None:
    """`--speculative-config`'s JSON (empty: off); ValueError naming the field at fault."""
    if not text.strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError("--speculative-config: expected a JSON object")
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ValueError(f"--speculative-config: unknown field {unknown[0]!r} "
                         f"(known: {', '.join(_FIELDS)})")
    if raw.get("method") != "ngram":
        raise ValueError(f"--speculative-config: method must be \"ngram\", got "
                         f"{raw.get('method')!r}")
    k = _count(raw, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    high = _count(raw, "prompt_lookup_max", None, 1, 1024)
    low = _count(raw, "prompt_lookup_min", high, 1, high)
    off_above = (_count(raw, "disable_by_batch_size", None, 1, 1 << 20)
                 if raw.get("disable_by_batch_size") is not None else None)
    return NgramConfig(k, high, low, off_above)


def _count(raw: dict[str, object], name: str, default: int | None, low: int, high: int) -> int:
    value = raw.get(name, default)
    if value is None:
        raise ValueError(f"--speculative-config: {name} is required")
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"--speculative-config: {name} must be an integer in {low}..{high}, "
                         f"got {value!r}")
    return value


def propose(token_ids: list[int], config: NgramConfig, limit: int) -> list[int]:
    """Up to `limit` tokens that followed the latest earlier occurrence of the longest suffix
    of `token_ids` (prompt_lookup_max down to prompt_lookup_min tokens long); [] if none.

    The search runs over the ids as bytes (`bytes.rfind`, in C): the context a client chooses
    costs the tick a scan at memory speed, not a Python loop over every position."""
    num = len(token_ids)
    limit = min(limit, config.num_speculative_tokens)
    if limit <= 0 or num < 2:
        return []
    text = array("I", token_ids).tobytes()
    for n in range(min(config.prompt_lookup_max, num - 1), config.prompt_lookup_min - 1, -1):
        suffix = text[(num - n) * 4:]
        found: list[int] = []
        # Latest start first: the nearest context is the likeliest to be copied on; but one
        # too near the end to be followed by `limit` tokens (a run of one token) gives way to
        # an earlier one that is.
        last = (num - n - 1) * 4  # the latest byte a match may start at: before the suffix
        for _ in range(MAX_LOOKS):
            if last < 0 or (at := text.rfind(suffix, 0, last + len(suffix))) < 0:
                break
            last = at - 1
            if at % 4:
                continue  # across two ids' bytes: not a match of tokens
            start = at // 4 + n
            found = found or token_ids[start:start + limit]
            if start + limit <= num:
                return token_ids[start:start + limit]
        if found:
            return found
    return []


def speculable(seq: Sequence) -> bool:
    """No siblings to fork, no prompt logprobs to gather: each of its rows is then sampled from
    what one-token decoding would have sampled from (penalties, bad words and min_tokens count
    the drafts before a row: logits_processors.py; a grammar masks each row as of the drafts
    before it: guided.py)."""
    return not seq.fork_children and seq.prompt_logprobs is None


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts are accepted: the longest prefix equal to the ids sampled at the rows
    before them (`sampled` has one more row than `drafts`)."""
    n = 0
    for draft, token in zip(drafts, sampled, strict=False):
        if draft != token:
            break
        n += 1
    return n


class Speculation:
    """The engine's n-gram speculation: proposing for the scheduler, verifying for update,
    and the counters (vLLM's names: drafts, draft tokens, accepted tokens)."""

    def __init__(self, config: NgramConfig,
                 draft_bound: Callable[[], SearchBound] | None = None) -> None:
        self.config = config
        # A tick's bound on the grammar work of constrained sequences' drafts (Guidance's);
        # None: no grammars, so no constrained sequence to draft for.
        self.draft_bound = draft_bound
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def step_drafts(self, ready: list[Sequence], spare: int) -> list[list[int]]:
        """The drafts of each of a step's decodes, `spare` tokens of them in all, first come
        first served; none in a step of more decodes than disable_by_batch_size."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(ready) > limit:
            return [[] for _ in ready]
        out: list[list[int]] = []
        bound = self.draft_bound() if self.draft_bound is not None else None
        for seq in ready:
            proposed = self.drafts(seq, bound)[:spare] if spare > 0 else []
            spare -= len(proposed)
            out.append(proposed)
        return out

    def drafts(self, seq: Sequence, bound: SearchBound | None = None) -> list[int]:
        """This step's drafts for a sequence about to decode one token ([]: none); a
        constrained one's within `bound` (the tick's grammar work for drafts)."""
        seq.draft_sure = 0
        waiting = seq.draft_wait > 0  # its last drafts were all rejected: it waits, longer
        if waiting:
            seq.draft_wait -= 1
        if not speculable(seq):
            return []
        # Never past its max_tokens: the decode's own token is one, each draft one more; never
        # more than num_speculative_tokens, the server's or its request's (what a grammar
        # forces too: a pass gives a sequence at most 1 + k tokens, guarantee A20).
        room = seq.max_tokens - seq.num_generated - 1 if seq.max_tokens else 0
        cap = seq.params.num_speculative_tokens
        room = min(room, self.config.num_speculative_tokens, room if cap is None else cap)
        constraint = seq.constraint
        if constraint is None:
            return [] if waiting else propose(seq.token_ids, self.config, room)
        if bound is None:
            return []
        # What the grammar forces is drafted even while the n-gram's drafts wait.
        drafts, seq.draft_sure = constraint.draft(lambda forced, n: [] if waiting else propose(
            seq.token_ids + forced, self.config, n), room, bound)
        return drafts

    def verify(self, seqs: list[Sequence], drafts: dict[int, list[int]],
               rows: list[list[int]]) -> dict[int, int]:
        """Cuts each drafted row (index -> drafts) to its accepted drafts plus the bonus token,
        in place; each one's number of accepted drafts. A sequence whose drafts were all
        rejected drafts none for 2, 4, ... MAX_DRAFT_WAIT steps (its text stopped copying); a
        constrained one whose n-gram drafts after those its grammar forced were all rejected,
        only the grammar's (those are judged by nothing: a key's spelling is not a sign that
        the text copies)."""
        counts: dict[int, int] = {}
        for i, proposed in drafts.items():
            n = accepted(proposed, rows[i])
            del rows[i][n + 1:]
            counts[i] = n
            seq = seqs[i]
            sure = seq.draft_sure
            if len(proposed) > sure:  # the n-gram's drafts, judged
                missed = n <= sure
                seq.draft_misses = seq.draft_misses + 1 if missed else 0
                seq.draft_wait = min(1 << seq.draft_misses, MAX_DRAFT_WAIT) if missed else 0
            self.num_drafts += 1
            self.num_draft_tokens += len(proposed)
            self.num_accepted_tokens += n
        return counts
