"""Greedy generation through the real engine, and the same prompts through transformers."""

from __future__ import annotations

from typing import Any

import torch

from daemon.engine.core import Engine
from daemon.model.loader import LoadedModel
from daemon.model.parallel.driver import DriverRunner
from daemon.model.runner import ModelRunner
from ipc.records import Delta, RequestKind, SamplingParams, Submit
from ipc.wire import ToProxy

PROMPTS = ["Zebras vex quirky jocks; 42 sphinx? 17 wyvern! blimp",
           "Kwartz 93 glyph vox: ibex, yak & 58 mjolnir", "a short one",
           "the quick brown fox jumps over the lazy dog, twice"]
Tokens = dict[tuple[str, int], list[int]]  # (request id, choice index) -> generated ids


def completion(rid: str, prompt: str, n: int = 1, max_tokens: int = 24) -> Submit:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Submit(rid, RequestKind.COMPLETION, params, n=n, prompts=[prompt], epoch=1)


def greedy(runner: ModelRunner | DriverRunner, loaded: LoadedModel, prompts: list[str],
           max_tokens: int, budget: int) -> tuple[Tokens, Engine]:
    """Each prompt's greedy tokens, the first prompt with n=2 (a forked sequence); at most
    `budget` tokens a tick, so that longer prompts are prefilled in chunks."""
    engine = Engine(runner, loaded.tokenizer, None, 8, budget, loaded.max_model_len,
                    loaded.name)
    for i, prompt in enumerate(prompts):
        engine.submit(completion(f"r{i}", prompt, n=2 if i == 0 else 1, max_tokens=max_tokens))
    out: list[ToProxy] = []
    for _ in range(2000):
        if not engine.has_work:
            break
        out += engine.step()
    tokens: Tokens = {}
    for r in out:
        if isinstance(r, Delta):
            tokens.setdefault((r.rid, r.index), []).extend(r.token_ids)
    return tokens, engine


def transformers_greedy(hf: Any, loaded: LoadedModel, prompts: list[str],
                        max_tokens: int) -> Tokens:
    """What transformers' generate makes of the same prompts (each choice of the first)."""
    tokens: Tokens = {}
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([loaded.tokenizer.encode(prompt)])
        # The mask said outright: generate would otherwise mask a BOS that is also the pad id.
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        for index in range(2 if i == 0 else 1):
            tokens[f"r{i}", index] = out[0, ids.shape[1]:].tolist()
    return tokens
