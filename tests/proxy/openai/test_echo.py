"""How completions render what the daemon sends for echo (prompt Deltas), continuous usage, and
the budget of a request without max_tokens that does not stream."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest

from ipc.records import Delta, Finish, FinishReason, SamplingParams, Submit, TokenLogprob, Usage
from proxy.engine.batching import merge_deltas
from proxy.engine.collected import CollectedBudget, collected_bytes
from proxy.http.errors import ApiError
from proxy.openai.completion_answer import CHAT, COMPLETION, CompletionAnswer, Wants
from tests.support.raw_http import sse_json

PROMPT = [TokenLogprob(b"<s>", 0.0), TokenLogprob(b"he", -1.0, [(b"he", -1.0)]),
          TokenLogprob(b"llo", -2.0, [(b"lo", -0.5)])]


def records(rid: str = "c") -> list[Delta | Finish]:
    """An echo in two pieces (the second carries only log-probabilities), then two tokens."""
    return [Delta(rid, 0, "hello", [1, 2, 3], [*PROMPT[:2]], prompt=True),
            Delta(rid, 0, "", [], [PROMPT[2]], prompt=True),
            Delta(rid, 0, " w", [7], [TokenLogprob(b" w", -0.1)], prompt_tokens=3),
            Delta(rid, 0, "x", [8], [TokenLogprob(b"x", -0.2)]),
            Finish(rid, 0, FinishReason.LENGTH, Usage(3, 2))]


def answer(stream: bool, budget: CollectedBudget | None = None, usage: bool = False,
           continuous: bool = False) -> CompletionAnswer:
    submit = Submit("c", COMPLETION.kind, SamplingParams(max_tokens=2, logprobs=1, echo=True),
                    prompts=["hello"])
    return CompletionAnswer(submit, COMPLETION, "m", Wants(stream, usage, True, continuous),
                            budget)


def test_a_collected_echo_is_the_prompt_then_the_answer_with_null_first_logprob() -> None:
    a = answer(False)
    a.collect(records())
    [choice] = orjson.loads(orjson.dumps(a.body()))["choices"]
    assert choice["text"] == "hello wx"
    assert (choice["prompt_token_ids"], choice["token_ids"]) == ([1, 2, 3], [7, 8])
    lp = choice["logprobs"]
    assert lp["tokens"] == ["<s>", "he", "llo", " w", "x"]
    assert lp["token_logprobs"] == [None, -1.0, -2.0, -0.1, -0.2]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][2] == {"lo": -0.5}


def test_a_streamed_echo_renders_each_piece_and_offsets_continue() -> None:
    events, done = answer(True).render(records())
    assert done
    chunks = [sse_json(line) for line in events.decode().split("\n") if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks]
    assert [c["text"] for c in choices] == ["hello", "", " w", "x", ""]
    assert choices[0]["prompt_token_ids"] == [1, 2, 3] and choices[0]["token_ids"] == []
    assert "prompt_token_ids" not in choices[1] and choices[2]["token_ids"] == [7]
    logprobs = [c["logprobs"] for c in choices[:4]]
    assert logprobs[0]["token_logprobs"] == [None, -1.0] and logprobs[0]["top_logprobs"][0] is None
    # "<s>" then "he": the second piece starts after both; the answer after the prompt's text.
    assert [lp["text_offset"] for lp in logprobs] == [[0, 3], [5], [5], [7]]


def test_merging_never_joins_an_echo_with_the_answer() -> None:
    merged = merge_deltas(records(), 64)
    assert [(type(r).__name__, getattr(r, "prompt", None)) for r in merged] == [
        ("Delta", True), ("Delta", True), ("Delta", False), ("Finish", None)]
    assert merged[2].token_ids == [7, 8] and merged[2].prompt_tokens == 3  # type: ignore[union-attr]


@pytest.mark.parametrize("shape", [COMPLETION, CHAT], ids=["completion", "chat"])
def test_continuous_usage_is_in_every_chunk(shape: Any) -> None:
    submit = Submit("c", shape.kind, SamplingParams(max_tokens=2), n=2, prompts=["p"])
    a = CompletionAnswer(submit, shape, "m", Wants(True, True, False, True))
    batch: list[Delta | Finish] = [
        Delta("c", 0, "a", [1], prompt_tokens=4), Delta("c", 1, "b", [2], prompt_tokens=4),
        Delta("c", 0, "c", [3]), Finish("c", 0, FinishReason.LENGTH, Usage(4, 2)),
        Finish("c", 1, FinishReason.LENGTH, Usage(4, 1))]
    events, done = a.render(batch)
    chunks = [sse_json(line) for line in events.decode().split("\n") if line.startswith("data: {")]
    assert done and [c["usage"]["completion_tokens"] for c in chunks] == [1, 1, 2, 2, 1, 3]
    assert all(c["usage"]["prompt_tokens"] == 4 for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 7


def test_the_budget_counts_what_arrives_and_names_the_field() -> None:
    per_token = collected_bytes(1, 1, 1)
    a = answer(False, CollectedBudget(per_token * 4, 1, "max_tokens"))
    a.collect(records()[:1])  # the echoed prompt's three ids count
    with pytest.raises(ApiError) as info:
        a.collect(records()[2:4])
    assert (info.value.param, info.value.code) == ("max_tokens", "output_too_large")
    assert "5 tokens" in info.value.message and "stream" in info.value.message
    assert not math.isnan(PROMPT[0].logprob)  # the record, not the shared constant, was marked
