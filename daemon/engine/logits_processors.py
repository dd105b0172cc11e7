"""What the sampler does to a batch's logits before it draws: bans, biases and penalties, with
vLLM's semantics and in its order (vllm/v1/sample/sampler.py, `apply_logits_processors`):

1. bad words: the last token of a bad word's token sequence is banned where the output ends with
   the tokens before it (vllm/v1/sample/ops/bad_words.py), and min_tokens' ban of EOS and
   stop_token_ids;
2. logit_bias, added to the logits of its token ids;
3. penalties (vllm/model_executor/layers/utils.py `apply_penalties`): repetition divides a
   positive logit and multiplies a negative one, for every token id in the prompt or the output;
   frequency subtracts its value times the id's count in the output, presence its value once
   for every id the output holds.

Temperature, min_p and top-k/top-p follow in the sampler. A ban is -inf, which a bias or a
penalty leaves at -inf, so bans and biases commute and take one pass each.

Penalties need each sequence's token counts. They live on the logits' device, one row per
penalised sequence in a pool (`TokenCounts`), filled once from the sequence's tokens and then
kept by one scatter-add of the ids each tick emits: nothing is read back to the host. The
sequence holds its row until it ends, when the engine gives it back (`release`).

A drafted sequence (speculative decoding) has a logits row per position, each given the drafts
before it (`ahead`): every one of them is processed as if those drafts were already its output
(counts, bad words, min_tokens), so it is the row one-token decoding would have sampled from.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from daemon.engine.sequence import Sequence
from ipc.records import SamplingParams

_NEG_INF = float("-inf")
_MIN_ROWS = 8


def penalised(params: SamplingParams) -> bool:
    return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0)


def processed(seq: Sequence, eos_token_ids: list[int], ahead: int = 0) -> bool:
    """Whether anything in this module changes the sequence's logits this tick (at the row
    `ahead` drafts past its output)."""
    p = seq.params
    if p.logit_bias or seq.bad_words or penalised(p):
        return True
    # Before min_tokens, EOS and stop_token_ids are banned (min_tokens is 0 for most).
    return (p.min_tokens > 0 and seq.num_generated + ahead < p.min_tokens
            and bool(p.stop_token_ids or (eos_token_ids and not p.ignore_eos)))


class TokenCounts:
    """Device rows of output token counts (float32, exact far past any context) and of which ids
    the prompt holds, one row per penalised sequence, grown by doubling."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        self._free: list[int] = []

    @property
    def num_rows(self) -> int:
        return 0 if self.counts is None else self.counts.shape[0]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def rows(self, seqs: list[Sequence], vocab: int, device: torch.device) -> torch.Tensor:
        """The rows of `seqs`, taken from the pool (and filled) for those without one yet."""
        for seq in seqs:
            if seq.penalty_row is None:
                seq.penalty_row = self._take(vocab, device)
                self._fill(seq)
        return torch.tensor([s.penalty_row for s in seqs], device=device)

    def add(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """Count each sequence's newly emitted token."""
        assert self.counts is not None
        device = self.counts.device
        index = torch.tensor([[s.penalty_row for s in seqs], tokens], device=device)
        self.counts.index_put_((index[0], index[1]), torch.ones(len(seqs), device=device),
                               accumulate=True)

    def release(self, seq: Sequence) -> None:
        if seq.penalty_row is not None:
            self._free.append(seq.penalty_row)
            seq.penalty_row = None

    def _take(self, vocab: int, device: torch.device) -> int:
        if not self._free:
            self._grow(vocab, device)
        return self._free.pop()

    def _grow(self, vocab: int, device: torch.device) -> None:
        old = self.num_rows
        size = max(_MIN_ROWS, 2 * old)
        counts = torch.zeros(size, vocab, device=device)
        in_prompt = torch.zeros(size, vocab, dtype=torch.bool, device=device)
        if self.counts is not None and self.in_prompt is not None:
            counts[:old] = self.counts
            in_prompt[:old] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self._free += range(size - 1, old - 1, -1)

    def _fill(self, seq: Sequence) -> None:
        """A row from what the sequence holds so far: its prompt, and whatever output it has."""
        assert self.counts is not None and self.in_prompt is not None
        row, device = seq.penalty_row, self.counts.device
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        prompt = torch.tensor(seq.token_ids[: seq.num_prompt_tokens], device=device)
        self.in_prompt[row].index_fill_(0, prompt, True)
        output = seq.token_ids[seq.num_prompt_tokens :]
        if output:
            ids = torch.tensor(output, device=device)
            self.counts[row].index_put_((ids,), torch.ones(len(output), device=device),
                                        accumulate=True)


class LogitsProcessors:
    def __init__(self, eos_token_ids: list[int]) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.counts = TokenCounts()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 ahead: list[list[int]] | None = None) -> torch.Tensor:
        """`logits` as the rows' bans, biases and penalties leave them: a copy (never the
        runner's output, nor the model's own distribution the log-probabilities report), or
        the same tensor when no row has any. `ahead[i]`: the tokens row i comes after beyond
        its sequence's (the drafts before it); None: none."""
        ahead = ahead or [[]] * len(seqs)
        rows = [i for i, s in enumerate(seqs)
                if processed(s, self.eos_token_ids, len(ahead[i]))]
        if not rows:
            return logits
        logits = logits.clone()
        self._bias(logits, seqs, rows)
        self._ban(logits, seqs, rows, ahead)
        penalised_rows = [i for i in rows if penalised(seqs[i].params)]
        if penalised_rows:
            self._penalise(logits, seqs, penalised_rows, ahead)
        return logits

    def count(self, seqs: list[Sequence], rows: list[list[int]]) -> None:
        """The tokens a step emits, each sequence's in its row (after constrained decoding had
        its say), into the counts of the penalised sequences."""
        pairs = [(s, t) for s, row in zip(seqs, rows, strict=True) if s.penalty_row is not None
                 for t in row]
        if pairs:
            self.counts.add([s for s, _ in pairs], [t for _, t in pairs])

    def release(self, seq: Sequence) -> None:
        self.counts.release(seq)

    def _bias(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        at: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        for row in rows:
            bias = seqs[row].params.logit_bias
            at += [row] * len(bias)
            ids += bias.keys()
            values += bias.values()
        if at:
            index = torch.tensor([at, ids], device=logits.device)
            logits.index_put_((index[0], index[1]),
                              torch.tensor(values, device=logits.device), accumulate=True)

    def _ban(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int],
             ahead: list[list[int]]) -> None:
        at: list[int] = []
        ids: list[int] = []
        for row in rows:
            banned = banned_ids(seqs[row], self.eos_token_ids, ahead[row])
            at += [row] * len(banned)
            ids += banned
        if at:
            index = torch.tensor([at, ids], device=logits.device)
            logits[index[0], index[1]] = _NEG_INF

    def _penalise(self, logits: torch.Tensor, all_seqs: list[Sequence], rows: list[int],
                  ahead: list[list[int]]) -> None:
        device = logits.device
        seqs = [all_seqs[i] for i in rows]
        index = torch.tensor(rows, device=device)
        own = self.counts.rows(seqs, logits.shape[1], device)
        assert self.counts.counts is not None and self.counts.in_prompt is not None
        counts = self.counts.counts.index_select(0, own)  # a copy: the drafts join it only
        drafted = [(at, t) for at, row in enumerate(rows) for t in ahead[row]]
        if drafted:
            at = torch.tensor(drafted, device=device).T
            counts.index_put_((at[0], at[1]),
                              torch.ones(len(drafted), device=device), accumulate=True)
        in_output = counts > 0
        part = logits.index_select(0, index)
        repetition = [s.params.repetition_penalty for s in seqs]
        if any(r != 1.0 for r in repetition):
            r = torch.tensor(repetition, device=device).unsqueeze(1)
            seen = in_output | self.counts.in_prompt.index_select(0, own)
            part = torch.where(seen, torch.where(part > 0, part / r, part * r), part)
            # A penalty float32 rounds to 0 (the edge takes any positive one) divides a logit
            # into infinity, which softmax turns into NaN: the largest finite logit instead.
            part = torch.nan_to_num(part, posinf=torch.finfo(part.dtype).max,
                                    neginf=float("-inf"))
        frequency = torch.tensor([s.params.frequency_penalty for s in seqs], device=device)
        presence = torch.tensor([s.params.presence_penalty for s in seqs], device=device)
        part = part - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * in_output
        logits.index_copy_(0, index, part)


def banned_ids(seq: Sequence, eos_token_ids: list[int],
               ahead: list[int] | tuple[()] = ()) -> list[int]:
    """Ids this sequence cannot take next (after `ahead` beyond its own tokens): a bad word's
    last token where the output ends with the rest of it, and while min_tokens is not reached,
    EOS and stop_token_ids."""
    p = seq.params
    out: list[int] = []
    if seq.bad_words:
        output = seq.token_ids[seq.num_prompt_tokens :]
        output += ahead
        for word in seq.bad_words:
            before = len(word) - 1
            if before <= len(output) and output[len(output) - before :] == word[:-1]:
                out.append(word[-1])
    if seq.num_generated + len(ahead) < p.min_tokens:
        out += p.stop_token_ids
        if not p.ignore_eos:
            out += eos_token_ids
    return out


def bad_word_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each bad word's token sequences, as vLLM tokenizes them (SamplingParams
    `update_from_tokenizer`): the word as written (leading spaces stripped), and once more after
    a space when that gives other tokens of the same count (the word inside a text)."""
    out: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        if not bare:
            continue
        out.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out
