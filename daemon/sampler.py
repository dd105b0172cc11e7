"""Next-token sampling for a batch of sequences, each with its own sampling parameters.

Sampling draws exponential noise and takes argmax(p / noise), which picks token i with
probability p_i. Seeded sequences draw their noise from their own generator, one row at a
time, so the same seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import torch

from daemon.sequence import Sequence

_MIX = 0x9E3779B97F4A7C15  # spreads (seed, sample) pairs over the generator's seed space


def seed_for(seed: int, sample_index: int) -> int:
    """The generator seed of choice `sample_index` of a request seeded with `seed`."""
    return (seed + sample_index * _MIX) % 2**64


class Sampler:
    def __init__(self, eos_token_ids: list[int], device: torch.device | str = "cpu") -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row of `logits` ([len(seqs), vocab], float32) for `seqs` in order."""
        if not seqs:
            return []
        logits = logits.float().clone()
        self._mask_early_stops(logits, seqs)
        temps = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
        greedy = temps == 0.0
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            sampled = self._sample(logits, seqs, temps)
            tokens = torch.where(greedy, tokens, sampled)
        return tokens.tolist()

    def _mask_early_stops(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        # min_tokens: EOS and stop_token_ids cannot be chosen until enough tokens exist.
        for row, seq in enumerate(seqs):
            p = seq.params
            if seq.num_generated >= p.min_tokens:
                continue
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
            if banned:
                logits[row, banned] = float("-inf")

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
