"""Penalties, logit_bias, bad words and min_p through the real engine and model runner against
transformers on the same checkpoint, with the same rules (vLLM's: repetition over prompt and
output, presence and frequency over the output, bias before penalties, min_p after
temperature), over 32 tokens; the prompt log-probabilities of echo; seeded sampling that
repeats whatever shares the batch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from daemon.engine.core import Engine
from daemon.model.loader import LoadedModel, load_model
from daemon.model.runner import ModelRunner
from ipc.records import Delta, RequestKind, SamplingParams, Submit
from ipc.wire import ToProxy
from tests.support.checkpoints import save_llama
from tests.support.greedy import PROMPTS

pytestmark = pytest.mark.timeout(300)

NEW_TOKENS = 32
BUDGET = 16  # tokens a tick: the prompts are prefilled in chunks


class PresenceFrequency(LogitsProcessor):
    """OpenAI's and vLLM's presence and frequency penalties, over the generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)
        output = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)  # type: ignore[return-value]


class OutputOnly(LogitsProcessor):
    """A transformers processor that sees the generated tokens only (vLLM's bad words)."""

    def __init__(self, prompt_len: int, inner: LogitsProcessor) -> None:
        self.prompt_len, self.inner = prompt_len, inner

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return self.inner(input_ids[:, self.prompt_len:], scores)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, LoadedModel]]:
    path = tmp_path_factory.mktemp("parity")
    hf = save_llama(path)
    yield hf, load_model(str(path), "cpu", torch.float32, kernels="auto")


def engine_of(loaded: LoadedModel, prefix_caching: bool = True) -> Engine:
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=64)
    return Engine(runner, loaded.tokenizer, None, 16, BUDGET, loaded.max_model_len, loaded.name,
                  prefix_caching=prefix_caching)


def run(engine: Engine, *submits: Submit) -> list[ToProxy]:
    out: list[ToProxy] = []
    for submit in submits:
        out += engine.submit(submit)
    for _ in range(1000):
        if not engine.has_work:
            return out
        out += engine.step()
    raise AssertionError("the engine did not finish")


def tokens(out: list[ToProxy], rid: str, index: int = 0) -> list[int]:
    return [t for r in out if isinstance(r, Delta) and r.rid == rid and r.index == index
            and not r.prompt for t in r.token_ids]


def completion(rid: str, prompt: str, **params: Any) -> Submit:
    params = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True, **params}
    return Submit(rid, RequestKind.COMPLETION, SamplingParams(**params), prompts=[prompt],
                  epoch=1)


def reference(hf: Any, ids: list[int], processors: list[LogitsProcessor],
              steps: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens of transformers with `processors` applied in the given order."""
    seq = torch.tensor([ids])
    chain = LogitsProcessorList(processors)
    with torch.no_grad():
        for _ in range(steps):
            scores = chain(seq, hf(seq).logits[:, -1].float())
            seq = torch.cat([seq, scores.argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(ids):].tolist()


CASES: list[tuple[str, dict[str, Any]]] = [
    ("repetition", {"repetition_penalty": 1.8}),
    ("presence", {"presence_penalty": 1.5}),
    ("frequency", {"frequency_penalty": 0.9}),
    ("all three", {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.6}),
]


def processors_for(params: dict[str, Any], prompt_len: int) -> list[LogitsProcessor]:
    out: list[LogitsProcessor] = []
    if "logit_bias" in params:
        out.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in params["logit_bias"].items()]))
    if "repetition_penalty" in params:
        out.append(RepetitionPenaltyLogitsProcessor(params["repetition_penalty"]))
    if "presence_penalty" in params or "frequency_penalty" in params:
        out.append(PresenceFrequency(prompt_len, params.get("presence_penalty", 0.0),
                                     params.get("frequency_penalty", 0.0)))
    return out


@pytest.mark.parametrize(("name", "params"), CASES)
def test_penalised_greedy_tokens_match_transformers(model: tuple[Any, LoadedModel], name: str,
                                                    params: dict[str, Any]) -> None:
    hf, loaded = model
    engine = engine_of(loaded)
    out = run(engine, *[completion(f"r{i}", p, **params) for i, p in enumerate(PROMPTS)],
              completion("plain", PROMPTS[0]))
    for i, prompt in enumerate(PROMPTS):
        ids = loaded.tokenizer.encode(prompt)
        assert tokens(out, f"r{i}") == reference(hf, ids, processors_for(params, len(ids))), i
    # The penalty does change what this model says.
    assert tokens(out, "r0") != tokens(out, "plain")
    counts = engine.sampler.processors.counts
    assert counts.num_free == counts.num_rows > 0  # every row back in the pool


def test_logit_bias_matches_transformers_and_logprobs_stay_the_models(
        model: tuple[Any, LoadedModel]) -> None:
    hf, loaded = model
    bias = {ord("e"): 6.0, ord(" "): 4.0, ord("a"): -100.0}
    params = {"logit_bias": bias, "repetition_penalty": 1.2}  # the bias comes first
    engine = engine_of(loaded)
    out = run(engine, completion("b", PROMPTS[1], logprobs=0, **params))
    ids = loaded.tokenizer.encode(PROMPTS[1])
    got = tokens(out, "b")
    assert got == reference(hf, ids, processors_for(params, len(ids)))
    assert ord("a") not in got and got.count(ord("e")) > 3
    # Reported log-probabilities are the model's own distribution, before any processor.
    lps = [lp.logprob for r in out if isinstance(r, Delta) for lp in r.logprobs or ()]
    with torch.no_grad():
        raw = torch.log_softmax(hf(torch.tensor([ids + got])).logits[0].float(), dim=-1)
    expected = [raw[len(ids) - 1 + j, t].item() for j, t in enumerate(got)]
    assert lps == pytest.approx(expected, abs=1e-4)


def test_bad_words_match_transformers_over_the_output(model: tuple[Any, LoadedModel]) -> None:
    hf, loaded = model
    plain = run(engine_of(loaded), completion("p", PROMPTS[2]))
    said = tokens(plain, "p")
    # Ban the pairs this model does say, by their text: the second token goes.
    words = [loaded.tokenizer.decode(said[i:i + 2]) for i in (0, 5, 11)]
    out = run(engine_of(loaded), completion("w", PROMPTS[2], bad_words=words))
    ids = loaded.tokenizer.encode(PROMPTS[2])
    banned = [loaded.tokenizer.encode(w, add_special_tokens=False) for w in words]
    ref = reference(hf, ids, [OutputOnly(len(ids), NoBadWordsLogitsProcessor(banned))])
    got = tokens(out, "w")
    assert got == ref and got != said
    assert not any(got[i:i + len(w)] == w for w in banned for i in range(len(got)))


def test_min_p_keeps_what_transformers_keeps_and_one_is_greedy(
        model: tuple[Any, LoadedModel]) -> None:
    hf, loaded = model
    ids = loaded.tokenizer.encode(PROMPTS[3])
    # Below 1 the temperature narrows what min_p keeps: applied before it, more would pass.
    out = run(engine_of(loaded), *[completion(f"m{s}", PROMPTS[3], temperature=0.6, min_p=0.1,
                                              seed=s) for s in range(4)],
              completion("one", PROMPTS[3], temperature=1.3, min_p=1.0, seed=5),
              completion("greedy", PROMPTS[3]))
    got = [t for s in range(4) for t in tokens(out, f"m{s}")]
    warper = MinPLogitsWarper(0.1)
    kept_sizes = []
    with torch.no_grad():
        for s in range(4):
            said = tokens(out, f"m{s}")
            for j, token in enumerate(said):
                prefix = torch.tensor([ids + said[:j]])
                scores = warper(prefix, hf(prefix).logits[:, -1].float() / 0.6)
                kept = (scores[0] > float("-inf")).nonzero().flatten().tolist()
                assert token in kept, (s, j)
                kept_sizes.append(len(kept))
    assert max(kept_sizes) > 1 and min(kept_sizes) < loaded.config.vocab_size // 4
    assert len(set(got)) > 8
    assert tokens(out, "one") == tokens(out, "greedy") == reference(hf, ids, [])


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_echo_prompt_logprobs_match_transformers(tmp_path: Path, kernels: str) -> None:
    hf = save_llama(tmp_path)
    loaded = load_model(str(tmp_path), "cpu", torch.float32, kernels=kernels)
    prompt = PROMPTS[0] * 2  # longer than a tick's budget: several chunks
    ids = loaded.tokenizer.encode(prompt)
    assert len(ids) > 3 * BUDGET
    engine = engine_of(loaded)
    run(engine, completion("warm", prompt))  # its blocks are cached: echo must not use them
    out = run(engine, Submit("e", RequestKind.COMPLETION, SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, echo=True, logprobs=2), n=2,
        prompts=[prompt], epoch=1))
    with torch.no_grad():
        raw = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for index in (0, 1):
        echoed = [r for r in out if isinstance(r, Delta) and r.index == index and r.prompt]
        assert echoed[0].text == prompt and echoed[0].token_ids == ids
        entries = [lp for r in echoed for lp in r.logprobs or ()]
        assert len(entries) == len(ids)
        assert [lp.logprob for lp in entries[1:]] == pytest.approx(
            [raw[p - 1, ids[p]].item() for p in range(1, len(ids))], abs=1e-4)
        top = raw[len(ids) // 2 - 1].topk(2)
        assert [v for _, v in entries[len(ids) // 2].top] == pytest.approx(top.values.tolist(),
                                                                         abs=1e-4)
        # Then the generated tokens, as without echo.
        assert len(tokens(out, "e", index)) == 4


def test_seeded_sampling_repeats_at_batch_1_and_16(model: tuple[Any, LoadedModel]) -> None:
    _, loaded = model
    params = {"temperature": 1.0, "seed": 1234, "presence_penalty": 0.3, "min_p": 0.02,
              "top_p": 0.95}
    alone = tokens(run(engine_of(loaded), completion("s", PROMPTS[0], **params)), "s")
    crowd = [completion(f"c{i}", PROMPTS[i % 4], temperature=1.0, frequency_penalty=0.5, max_tokens=160,
                        seed=None if i % 2 else i) for i in range(15)]
    engine = engine_of(loaded)
    sizes: list[int] = []
    forward = engine.runner.run
    engine.runner.run = lambda chunks: (sizes.append(len(chunks)), forward(chunks))[1]  # type: ignore[method-assign]
    shared = run(engine, *crowd[:7], completion("s", PROMPTS[0], **params), *crowd[7:])
    assert max(sizes) == 16
    assert tokens(shared, "s") == alone and len(set(alone)) > 4
