"""Next-token sampling for a batch of sequences, each with its own sampling parameters.

In vLLM's order: the logits processors (bans, logit_bias, penalties: logits_processors.py), then
greedy rows take the argmax; the others are divided by their temperature, cut by min_p (tokens
less likely than min_p times the most likely one go) and by top-k/top-p, and drawn.

Sampling picks token i with probability p_i: an unseeded row inverts its cumulative
distribution at one uniform draw; a seeded row draws exponential noise from its own generator
and takes argmax(p / noise), one row at a time, so the same seed gives the same tokens whatever
else shares the batch.

The log-probabilities an answer reports, of its tokens and of an echoed prompt's, are the
model's own distribution, before any of that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from daemon.engine.logits_processors import LogitsProcessors
from daemon.engine.sequence import Sequence
from daemon.model.batch import ScheduledChunk
from ipc.records import TokenLogprob

if TYPE_CHECKING:
    from daemon.engine.echo import Echo

SAMPLING_EPS = 1e-5  # a temperature under this is greedy (vLLM's _SAMPLING_EPS)
_MIX = 0x9E3779B97F4A7C15  # spreads (seed, sample) pairs over the generator's seed space


def seed_for(seed: int, sample_index: int) -> int:
    """The generator seed of choice `sample_index` of a request seeded with `seed`."""
    return (seed + sample_index * _MIX) % 2**64


class Sampler:
    def __init__(self, eos_token_ids: list[int], device: torch.device | str = "cpu") -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.processors = LogitsProcessors(self.eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """`sample`, read back to the host."""
        return self.sample(logits, seqs).tolist() if seqs else []

    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               ahead: list[list[int]] | None = None) -> torch.Tensor:
        """One token per row of `logits` ([len(seqs), vocab], float32) for `seqs` in order;
        `ahead[i]`: the drafts row i follows (its bans and penalties count them).

        Everything runs on the logits' device and the ids stay there: no value is read back
        (which sequences are greedy is known on the host). The penalised sequences' counts
        take the emitted tokens from `count`."""
        if all([s.plain_draw for s in seqs]):  # nothing asked for but the draw itself
            return _draw(torch.softmax(logits.float(), dim=-1))
        logits = self.processors(logits.float(), seqs, ahead)
        # As vLLM: a temperature under SAMPLING_EPS is greedy (dividing by one that float32
        # rounds to 0 would make every logit infinite, and the draw NaN).
        greedy = [s.params.temperature < SAMPLING_EPS for s in seqs]
        if all(greedy):
            return logits.argmax(dim=-1)
        # A greedy row is drawn too (divided by 1), then takes its argmax instead.
        temps = [1.0 if g else s.params.temperature for s, g in zip(seqs, greedy, strict=True)]
        sampled = self._sample(logits, seqs, temps)
        if any(greedy):
            sampled = torch.where(torch.tensor(greedy, device=logits.device),
                                  logits.argmax(dim=-1), sampled)
        return sampled

    def count(self, seqs: list[Sequence], rows: list[list[int]]) -> None:
        """The tokens emitted this step, each sequence's in its row (constrained decoding may
        have replaced some)."""
        self.processors.count(seqs, rows)

    def release(self, seq: Sequence) -> None:
        """The sequence ended: what the sampler kept for it goes."""
        self.processors.release(seq)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence],
                temps: list[float]) -> torch.Tensor:
        if any(t != 1.0 for t in temps):  # dividing by 1 changes nothing: most clients set none
            logits = logits / torch.tensor(temps, device=logits.device).unsqueeze(1)
        logits = _min_p(logits, seqs)
        logits = _top_k_top_p(logits, seqs)
        probs = torch.softmax(logits, dim=-1)
        seeded = [i for i, s in enumerate(seqs) if s.seed is not None]
        if not seeded:
            return _draw(probs)
        out = torch.empty(len(seqs), dtype=torch.long, device=probs.device)
        unseeded = [i for i, s in enumerate(seqs) if s.seed is None]
        if unseeded:
            out[unseeded] = _draw(probs[unseeded])
        seeded_probs = probs[seeded]
        noise = torch.empty_like(seeded_probs)
        for row, i in enumerate(seeded):
            seq = seqs[i]
            if seq.rng is None and seq.seed is not None:
                seq.rng = torch.Generator(device=probs.device).manual_seed(seq.seed)
            noise[row].exponential_(generator=seq.rng)
        out[seeded] = (seeded_probs / noise).argmax(dim=-1)
        return out


def _draw(probs: torch.Tensor) -> torch.Tensor:
    """One token per row, token i with probability probs[i]: the first whose cumulative
    probability reaches a uniform draw in (0, total]. One random number a row, not one a
    token: exponential noise over the vocabulary was the largest cost of a tick at hundreds of
    streams on the CPU. (Seeded rows keep that noise, drawn from their own generators, so
    their tokens stay what their seed gave.)"""
    cdf = probs.cumsum(dim=-1)
    draw = (1.0 - torch.rand(probs.shape[0], 1, device=probs.device)) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, draw)
    # The host sums a row in order, so a token of probability 0 repeats the sum before it and
    # is never the first to reach the draw. A GPU's scan sums in another order: where rounding
    # makes such a token look picked there, the most likely token instead.
    if probs.device.type != "cpu":
        picked = torch.where(probs.gather(1, picked.clamp_(max=probs.shape[-1] - 1)) > 0,
                             picked, probs.argmax(dim=-1, keepdim=True))
    return picked.squeeze(1)


def _min_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Tokens less likely than min_p times the most likely one dropped (after temperature)."""
    min_ps = [s.params.min_p for s in seqs]
    if not any(min_ps):
        return logits
    probs = torch.softmax(logits, dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(
        min_ps, device=logits.device, dtype=probs.dtype).unsqueeze(1)
    return logits.masked_fill(probs < floor, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    vocab = logits.shape[-1]
    top_ks = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs]
    top_ps = [s.params.top_p for s in seqs]
    if all(k == vocab for k in top_ks) and all(p >= 1.0 for p in top_ps):
        return logits
    ordered, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor(top_ks, device=logits.device).unsqueeze(1)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= ks
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    # Keep a token while the mass strictly before it is below top_p (the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    ps = torch.tensor(top_ps, device=logits.device, dtype=probs.dtype).unsqueeze(1)
    drop |= mass_before >= ps
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, ordered)


Logprob = tuple[float, list[tuple[int, float]]]


def sampled_logprobs(logits: torch.Tensor, seqs: list[Sequence], rows: list[list[int]],
                     starts: list[int] | None,
                     to_token_logprob: Callable[[int, Logprob], TokenLogprob],
                     ) -> list[list[TokenLogprob] | None]:
    """Per sequence, for each of its emitted tokens (`rows[i]`, whose logits are rows
    `starts[i]`, `starts[i] + 1`, ... of `logits`; None: row i, one token a sequence): the
    token's log-probability and the top `params.logprobs` (id, logprob) pairs, most likely
    first; None for sequences that did not ask.

    Under the model's own distribution (the logits before the logits processors, temperature,
    min_p, top-k/top-p and the min_tokens mask), as vLLM reports them by default."""
    asked = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    out: list[list[TokenLogprob] | None] = [None] * len(seqs)
    if not asked:
        return out
    index: list[int] = []
    tokens: list[int] = []
    ks: list[int] = []
    for i in asked:
        start = i if starts is None else starts[i]
        index += range(start, start + len(rows[i]))
        tokens += rows[i]
        ks += [seqs[i].params.logprobs or 0] * len(rows[i])
    found = token_logprobs(logits.index_select(0, torch.tensor(index, device=logits.device)),
                           tokens, ks)
    at = 0
    for i in asked:
        out[i] = [to_token_logprob(t, lp) for t, lp in zip(rows[i], found[at:], strict=False)]
        at += len(rows[i])
    return out


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[Logprob]:
    """Per row of `logits`: the log-probability of `tokens[row]` and the `ks[row]` most likely
    (id, logprob) pairs, floored at -9999.0 as OpenAI reports "impossible" (JSON has no -inf)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1).clamp(min=-9999.0)
    chosen = torch.tensor(tokens, device=logits.device)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    k = max(ks)
    top_lp, top_ids = (logprobs.topk(min(k, logprobs.shape[-1]), dim=-1) if k else
                       (logprobs[:, :0], logprobs[:, :0].long()))
    top_lp_rows, top_id_rows = top_lp.tolist(), top_ids.tolist()
    return [(chosen_lp[j], list(zip(top_id_rows[j][:n], top_lp_rows[j][:n], strict=True)))
            for j, n in enumerate(ks)]


def prompt_logprobs(chunks: list[ScheduledChunk], seqs: list[Sequence], logits: torch.Tensor,
                    to_token_logprob: Callable[[int, Logprob], TokenLogprob]) -> None:
    """Echo's prompt log-probabilities (daemon/engine/echo.py) from this tick's rows of every
    chunk with all_logits: row j of a chunk starting at position s gives the entry of prompt
    token s + j + 1, under the model's own distribution too."""
    rows: list[int] = []
    targets: list[tuple[Echo, int]] = []
    row = 0
    for chunk, seq in zip(chunks, seqs, strict=True):
        echo = seq.prompt_logprobs
        if chunk.all_logits and echo is not None:
            for j in range(len(chunk.token_ids)):
                position = chunk.start_pos + j + 1
                if len(echo.logprobs) <= position < len(echo.token_ids):
                    rows.append(row + j)
                    targets.append((echo, position))
        row += chunk.num_logit_rows
    if not rows:
        return
    index = torch.tensor(rows, device=logits.device)
    found = token_logprobs(logits.index_select(0, index),
                           [echo.token_ids[p] for echo, p in targets],
                           [echo.num_logprobs or 0 for echo, _ in targets])
    for (echo, position), lp in zip(targets, found, strict=True):
        if position == len(echo.logprobs):  # in order; a recomputed entry is already there
            echo.logprobs.append(to_token_logprob(echo.token_ids[position], lp))
