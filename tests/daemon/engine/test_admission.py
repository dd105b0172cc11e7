"""Admission's side of the new fields: an omitted max_tokens is the rest of the context (never a
false overflow), token-id prompts checked against the vocabulary, logit_bias ids too, and the
answers of /tokenize and /detokenize."""

from __future__ import annotations

import pytest

from daemon.engine.admission import output_room
from daemon.engine.block_manager import BlockManager
from ipc.records import (
    Delta,
    Error,
    Finish,
    FinishReason,
    Message,
    RequestKind,
    SamplingParams,
    Submit,
)
from tests.support.engine_kit import TOK, completion, finishes, make_engine, run


def test_an_omitted_max_tokens_is_the_rest_of_the_context() -> None:
    engine, _ = make_engine(max_model_len=100)  # the fake model never says EOS
    engine.submit(completion("a", "x" * 60, max_tokens=None, ignore_eos=True))
    engine.submit(completion("b", "x" * 98, max_tokens=None))
    out = run(engine)
    a, b = finishes(out, "a")[0], finishes(out, "b")[0]
    assert (a.reason, a.usage.prompt_tokens, a.usage.completion_tokens) == (
        FinishReason.LENGTH, 61, 39)
    assert (b.usage.prompt_tokens, b.usage.completion_tokens) == (99, 1)


def test_a_max_tokens_ceiling_past_the_room_is_the_room() -> None:
    """The Messages API's reading: under the room the ceiling bounds the output, past it the
    room does, where a plain max_tokens would be refused."""
    engine, _ = make_engine(max_model_len=100)
    for rid, max_tokens in (("a", 500), ("b", 10)):
        engine.submit(completion(rid, "x" * 60, max_tokens=max_tokens, max_tokens_ceiling=True,
                                 ignore_eos=True))
    out = run(engine)
    a, b = finishes(out, "a")[0], finishes(out, "b")[0]
    assert (a.reason, a.usage.prompt_tokens + a.usage.completion_tokens) == (
        FinishReason.LENGTH, 100)
    assert (b.reason, b.usage.completion_tokens) == (FinishReason.LENGTH, 10)
    [err] = engine.submit(completion("c", "x" * 60, max_tokens=500))
    assert isinstance(err, Error) and err.param == "max_tokens"


def test_a_prompt_list_resolves_each_prompts_own_room() -> None:
    engine, _ = make_engine(max_model_len=64)
    submit = Submit("a", RequestKind.COMPLETION, SamplingParams(max_tokens=None), n=2,
                    prompts=["x" * 10, "y" * 40], epoch=1)
    engine.submit(submit)
    got = {i: f.usage.completion_tokens for i, f in finishes(run(engine), "a").items()}
    assert got == {0: 53, 1: 53, 2: 23, 3: 23}


def test_the_rest_of_the_context_stops_at_what_the_kv_cache_holds() -> None:
    # 8 blocks of 16 hold 128 tokens, under the context of 512: the sequence could never grow
    # past them alone, so its room stops there.
    engine, _ = make_engine(num_blocks=8, max_model_len=512)
    engine.submit(completion("a", "x" * 20, max_tokens=None))
    [fin] = finishes(run(engine), "a").values()
    assert (fin.reason, fin.usage.prompt_tokens + fin.usage.completion_tokens) == (
        FinishReason.LENGTH, 128)
    bm = BlockManager(8, 16)
    assert output_room(21, 1, 512, bm) == 107
    assert output_room(21, 3, 512, bm) == 128 - 2 * 16 * bm.fork_cost(21) - 21
    assert output_room(21, 1, 100, bm) == 79


@pytest.mark.parametrize(("submit", "param", "words"), [
    (completion("a", "x" * 100, max_tokens=None), "prompt", "no room left for the output"),
    (Submit("a", RequestKind.CHAT, SamplingParams(max_tokens=None),
            messages=[Message("user", "x" * 120)], epoch=1), "messages", "no room left"),
    (completion("a", "x" * 90, max_tokens=None, min_tokens=20), "min_tokens", "(9 tokens)"),
])
def test_without_max_tokens_only_the_prompt_can_be_too_long(submit: Submit, param: str,
                                                            words: str) -> None:
    engine, _ = make_engine(max_model_len=100)
    [err] = engine.submit(submit)
    assert isinstance(err, Error) and err.param == param and words in err.message, err


def test_a_prompt_that_fills_the_kv_cache_alone_is_refused_naming_it() -> None:
    engine, _ = make_engine(num_blocks=4, max_model_len=512)
    [err] = engine.submit(completion("a", "x" * 63, max_tokens=None))
    assert isinstance(err, Error) and err.param == "prompt" and "KV cache" in err.message


def test_token_id_prompts_run_as_their_text_would() -> None:
    engine, _ = make_engine()
    ids = TOK.encode("hello")
    engine.submit(Submit("ids", RequestKind.COMPLETION, SamplingParams(temperature=0.0),
                         prompt_ids=[ids, ids[:3]], epoch=1))
    engine.submit(completion("text", "hello", temperature=0.0))
    out = run(engine)
    def of(rid: str, index: int) -> list[int]:
        return [t for r in out if isinstance(r, Delta) and r.rid == rid and r.index == index
                for t in r.token_ids]
    assert of("ids", 0) == of("text", 0) and len(of("ids", 1)) == 16
    assert finishes(out, "ids")[1].usage.prompt_tokens == 3


@pytest.mark.parametrize(("submit", "param"), [
    (Submit("a", RequestKind.COMPLETION, SamplingParams(), prompt_ids=[[1, 10**6]], epoch=1),
     "prompt"),
    (Submit("a", RequestKind.COMPLETION, SamplingParams(), prompt_ids=[[1], [-3]], epoch=1),
     "prompt"),
    (completion("a", logit_bias={TOK.vocab_size: 1.0}), "logit_bias"),
])
def test_ids_outside_the_vocabulary_are_refused_naming_the_field(submit: Submit,
                                                                 param: str) -> None:
    engine, _ = make_engine()
    [err] = engine.submit(submit)
    assert isinstance(err, Error) and err.param == param and "vocabulary" in err.message


def test_tokenize_and_detokenize_are_answered_without_a_session() -> None:
    engine, runner = make_engine()
    text = "héllo <|im_start|>"
    out = engine.submit(Submit("t", RequestKind.TOKENIZE, SamplingParams(), prompts=[text]))
    [delta, fin] = out
    assert isinstance(delta, Delta) and delta.token_ids == TOK.encode(text)
    assert isinstance(fin, Finish) and fin.usage.prompt_tokens == len(delta.token_ids)
    [bare, _] = engine.submit(Submit("u", RequestKind.TOKENIZE, SamplingParams(), prompts=[text],
                                     add_special_tokens=False))
    assert isinstance(bare, Delta) and bare.token_ids == TOK.encode(text, add_special_tokens=False)
    messages = [Message("user", "hi")]
    [chat, _] = engine.submit(Submit("c", RequestKind.TOKENIZE, SamplingParams(),
                                     messages=messages, add_generation_prompt=False))
    rendered = TOK.apply_chat_template([{"role": "user", "content": "hi"}],
                                       add_generation_prompt=False)
    assert isinstance(chat, Delta) and chat.token_ids == TOK.encode(rendered,
                                                                   add_special_tokens=False)
    [back, _] = engine.submit(Submit("d", RequestKind.DETOKENIZE, SamplingParams(),
                                     prompt_ids=[delta.token_ids]))
    assert isinstance(back, Delta) and back.text == "héllo "  # special tokens are skipped
    [err] = engine.submit(Submit("e", RequestKind.DETOKENIZE, SamplingParams(),
                                 prompt_ids=[[1, 10**6]]))
    assert isinstance(err, Error) and err.param == "tokens"
    assert not engine.sessions and not runner.passes
