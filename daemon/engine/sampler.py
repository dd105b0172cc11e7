"""Next-token sampling for a batch of sequences, each with its own sampling parameters.

Sampling draws exponential noise and takes argmax(p / noise), which picks token i with
probability p_i. Seeded sequences draw their noise from their own generator, one row at a
time, so the same seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import torch

from daemon.engine.sequence import Sequence

_MIX = 0x9E3779B97F4A7C15  # spreads (seed, sample) pairs over the generator's seed space


def seed_for(seed: int, sample_index: int) -> int:
    """The generator seed of choice `sample_index` of a request seeded with `seed`."""
    return (seed + sample_index * _MIX) % 2**64


class Sampler:
    def __init__(self, eos_token_ids: list[int], device: torch.device | str = "cpu") -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row of `logits` ([len(seqs), vocab], float32) for `seqs` in order.

        Everything runs on the logits' device; the sampled ids cross to the host once, and no
        other value is read back (which sequences are greedy is known on the host)."""
        if not seqs:
            return []
        logits = logits.float()
        banned = self._early_stops(seqs)
        if banned[0]:
            logits = logits.clone()  # never write into the runner's output
            logits[banned] = float("-inf")
        greedy = [s.params.temperature == 0.0 for s in seqs]
        tokens = logits.argmax(dim=-1)
        if not all(greedy):
            temps = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
            sampled = self._sample(logits, seqs, temps)
            tokens = sampled if not any(greedy) else torch.where(temps == 0.0, tokens, sampled)
        return tokens.tolist()

    def _early_stops(self, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """(rows, ids) that min_tokens forbids: EOS and stop_token_ids cannot be chosen until
        enough tokens exist."""
        rows: list[int] = []
        ids: list[int] = []
        for row, seq in enumerate(seqs):
            p = seq.params
            if seq.num_generated >= p.min_tokens:
                continue
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
            rows += [row] * len(banned)
            ids += banned
        return rows, ids

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence],
                temps: torch.Tensor) -> torch.Tensor:
        safe_temps = torch.where(temps == 0.0, torch.ones_like(temps), temps)
        logits = logits / safe_temps.unsqueeze(1)
        logits = _top_k_top_p(logits, seqs)
        probs = torch.softmax(logits, dim=-1)
        noise = self._noise(probs, seqs)
        return (probs / noise).argmax(dim=-1)

    def _noise(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.seed is None]
        if len(unseeded) == len(seqs):
            return noise.exponential_()
        if unseeded:
            noise[unseeded] = torch.empty_like(probs[unseeded]).exponential_()
        for row, seq in enumerate(seqs):
            if seq.seed is None:
                continue
            if seq.rng is None:
                seq.rng = torch.Generator(device=probs.device).manual_seed(seq.seed)
            noise[row].exponential_(generator=seq.rng)
        return noise


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


def sampled_logprobs(logits: torch.Tensor, seqs: list[Sequence],
                     tokens: list[int]) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """Per row: the sampled token's log-probability and the top `params.logprobs` (id, logprob)
    pairs, most likely first; None for rows that did not ask.

    Under the model's own distribution (the logits before temperature, top-k/top-p and the
    min_tokens mask), as vLLM reports them by default."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    out: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(seqs)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    # Floored at -9999.0 as OpenAI reports "impossible": JSON has no -inf.
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1).clamp(min=-9999.0)
    chosen = torch.tensor([tokens[i] for i in rows], device=logits.device)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    k = max(seqs[i].params.logprobs or 0 for i in rows)
    top_lp, top_ids = (logprobs.topk(min(k, logprobs.shape[-1]), dim=-1) if k else
                       (logprobs[:, :0], logprobs[:, :0].long()))
    top_lp_rows, top_id_rows = top_lp.tolist(), top_ids.tolist()
    for j, row in enumerate(rows):
        n = seqs[row].params.logprobs or 0
        out[row] = (chosen_lp[j], list(zip(top_id_rows[j][:n], top_lp_rows[j][:n], strict=True)))
    return out
