"""Bans, biases and penalties as vLLM defines them, on hand-made logits; their per-sequence
counts on the device, freed when the sequence ends."""

from __future__ import annotations

import math

import pytest
import torch

from daemon.engine.logits_processors import LogitsProcessors, bad_word_ids, banned_ids
from daemon.engine.sampler import Sampler, seed_for
from daemon.engine.sequence import Sequence
from daemon.model.tokenizer import ByteTokenizer
from ipc.records import AbortCause, SamplingParams
from tests.support.engine_kit import completion, make_engine

TOK = ByteTokenizer()
VOCAB = 16
EOS = 15


def seq(prompt: list[int], output: list[int] = (), index: int = 0, seed: int | None = None,  # type: ignore[assignment]
        bad_words: list[list[int]] | None = None, **params: object) -> Sequence:
    s = Sequence("r", index, list(prompt), SamplingParams(**params),  # type: ignore[arg-type]
                 seed=None if seed is None else seed_for(seed, index),
                 bad_words=bad_words or [])
    s.token_ids += list(output)
    return s


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor([r + [0.0] * (VOCAB - len(r)) for r in rows])


def test_presence_and_frequency_count_the_output_only() -> None:
    # Prompt holds 1 and 2; output holds 2 twice and 3 once.
    s = seq([1, 2], [2, 3, 2], presence_penalty=0.5, frequency_penalty=0.25)
    out = LogitsProcessors([EOS])(logits([1.0, 1.0, 1.0, 1.0]), [s])
    assert out[0, :4].tolist() == [1.0, 1.0, 1.0 - 0.5 - 2 * 0.25, 1.0 - 0.5 - 0.25]


def test_repetition_divides_positive_and_multiplies_negative_over_prompt_and_output() -> None:
    s = seq([1], [2], repetition_penalty=2.0)
    out = LogitsProcessors([EOS])(logits([3.0, 3.0, -3.0, 3.0]), [s])
    assert out[0, :4].tolist() == [3.0, 1.5, -6.0, 3.0]


def test_logit_bias_is_added_and_bans_stay_banned() -> None:
    s = seq([1], logit_bias={0: 5.0, 3: -100.0, EOS: 50.0}, min_tokens=2)
    out = LogitsProcessors([EOS])(logits([1.0, 1.0, 1.0, 1.0]), [s])
    assert out[0, :4].tolist() == [6.0, 1.0, 1.0, -99.0]
    assert out[0, EOS] == -math.inf  # min_tokens' ban wins over a bias


def test_bad_words_ban_the_last_token_after_the_rest_in_the_output() -> None:
    words = [[5], [6, 7], [8, 9, 10]]
    assert banned_ids(seq([6], [], bad_words=words), [EOS]) == [5]  # the prompt does not count
    assert banned_ids(seq([1], [6], bad_words=words), [EOS]) == [5, 7]
    assert banned_ids(seq([1], [8, 9], bad_words=words), [EOS]) == [5, 10]
    assert banned_ids(seq([8], [9], bad_words=words), [EOS]) == [5]
    s = seq([1], [6], bad_words=words)
    out = LogitsProcessors([EOS])(logits([0.0] * VOCAB), [s])
    assert out[0, 5] == out[0, 7] == -math.inf and out[0, 6] == 0.0


def test_bad_words_are_tokenized_as_vllm_does() -> None:
    def encode(text: str) -> list[int]:
        return {"no": [1, 2], " no": [3, 2], "x": [4], " x": [5, 6]}.get(text, [])

    # The bare word, plus after a space when that gives other tokens of the same length.
    assert bad_word_ids(["no", "x", ""], encode) == [[1, 2], [3, 2], [4]]


def test_penalties_apply_to_the_rows_that_have_them_only() -> None:
    plain, penalised = seq([1], [2]), seq([1], [2], presence_penalty=1.0)
    raw = logits([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    processors = LogitsProcessors([EOS])
    out = processors(raw, [plain, penalised])
    assert out[0].tolist() == raw[0].tolist() and out[1, 2] == 0.0
    assert raw[1, 2] == 1.0  # never written into the runner's logits
    assert processors(raw, [plain]) is raw  # nothing to do: no copy


def test_counts_follow_the_emitted_tokens_and_go_back_with_the_sequence() -> None:
    processors = LogitsProcessors([EOS])
    s = seq([1], [], frequency_penalty=1.0)
    for token in (4, 4, 6):  # as the engine does: process, sample, count what was emitted
        processors(logits([0.0] * VOCAB), [s])
        processors.count([s], [[token]])
        s.token_ids.append(token)
    out = processors(logits([0.0] * VOCAB), [s])
    assert out[0, 4] == -2.0 and out[0, 6] == -1.0 and out[0, 1] == 0.0
    counts = processors.counts
    assert s.penalty_row is not None and counts.num_rows > 0
    processors.release(s)
    assert s.penalty_row is None and counts.num_free == counts.num_rows


def test_a_row_taken_again_starts_from_its_new_sequence() -> None:
    processors = LogitsProcessors([EOS])
    first = seq([1], [3, 3], frequency_penalty=1.0)
    processors(logits([0.0] * VOCAB), [first])
    row = first.penalty_row
    processors.release(first)
    # A new sequence that already has output (a preempted one) is counted from its tokens.
    second = seq([2], [5], frequency_penalty=1.0, repetition_penalty=2.0)
    out = processors(logits([1.0] * VOCAB), [second])
    assert second.penalty_row == row
    assert out[0, 3] == 1.0 and out[0, 5] == 0.5 - 1.0 and out[0, 2] == 0.5


def test_the_pool_grows_and_keeps_its_rows() -> None:
    processors = LogitsProcessors([EOS])
    seqs = [seq([1], [i % VOCAB], index=i, presence_penalty=1.0) for i in range(20)]
    out = processors(torch.zeros(20, VOCAB), seqs)
    assert processors.counts.num_rows >= 20
    assert len({s.penalty_row for s in seqs}) == 20
    assert all(out[i, i % VOCAB] == -1.0 for i in range(20))


def test_min_p_drops_the_unlikely_after_temperature() -> None:
    raw = torch.full((400, VOCAB), -30.0)
    raw[:, 2] = 1.0
    raw[:, 3] = 1.0 - math.log(2)  # half as likely as 2
    raw[:, 4] = 1.0 - math.log(10)  # a tenth
    sampler = Sampler([EOS])
    drawn = sampler(raw, [seq([1], index=i, temperature=1.0, min_p=0.3, seed=i)
                          for i in range(400)])
    assert set(drawn) == {2, 3}
    drawn = sampler(raw, [seq([1], index=i, temperature=1.0, min_p=0.05, seed=i)
                          for i in range(400)])
    assert set(drawn) == {2, 3, 4}


def test_min_p_of_one_is_greedy() -> None:
    raw = torch.randn(64, VOCAB)
    seqs = [seq([1], index=i, temperature=1.5, min_p=1.0) for i in range(64)]
    assert Sampler([EOS])(raw, seqs) == raw.argmax(-1).tolist()


def test_greedy_follows_the_processed_logits() -> None:
    raw = logits([0.0, 2.0, 1.0])
    assert Sampler([EOS])(raw, [seq([1], temperature=0.0, repetition_penalty=4.0)]) == [2]
    assert Sampler([EOS])(raw, [seq([1], temperature=0.0, logit_bias={0: 3.0})]) == [0]


@pytest.mark.parametrize("batch", [1, 16])
def test_seeded_penalised_sampling_repeats_whatever_shares_the_batch(batch: int) -> None:
    def draw(others: int) -> list[int]:
        sampler = Sampler([EOS])
        target = seq([1, 2], seed=99, temperature=1.0, presence_penalty=0.5, min_p=0.01)
        crowd = [seq([3], index=i, temperature=1.0, frequency_penalty=1.0) for i in range(others)]
        out = []
        torch.manual_seed(others)  # the unseeded rows draw other noise each time
        for _ in range(24):
            seqs = [*crowd, target]
            tokens = sampler(torch.linspace(0, 1, VOCAB).repeat(len(seqs), 1), seqs)
            sampler.count(seqs, [[t] for t in tokens])
            for s, t in zip(seqs, tokens, strict=True):
                s.token_ids.append(t)
            out.append(tokens[-1])
        return out

    alone = draw(0)
    assert draw(batch - 1) == alone and len(set(alone)) > 1


def test_only_the_sampled_ids_are_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Penalties, biases, bans and min_p keep to the one read-back a tick: counts stay on the
    device and are updated there from the emitted ids."""
    sampler = Sampler([EOS])
    seqs = [seq([1, 2], [3], presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                temperature=0.7, min_p=0.1),
            seq([1], logit_bias={2: 3.0}, temperature=0.0),
            seq([1], [6], bad_words=[[6, 7]], temperature=1.0, top_k=4, seed=3)]
    sampler(torch.randn(3, VOCAB), seqs)  # the pool is made (once)
    reads: list[str] = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
        real = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: object, _real: object = real, _name: str = name,
                    **k: object) -> object:
            reads.append(_name)
            return _real(self, *a, **k)  # type: ignore[operator]

        monkeypatch.setattr(torch.Tensor, name, counted)
    raw = torch.randn(3, VOCAB)
    before = raw.clone()
    tokens = sampler(raw, seqs)
    sampler.count(seqs, [[t] for t in tokens])
    assert reads == ["tolist"]
    assert torch.equal(raw, before)


def test_a_sessions_rows_go_back_when_it_is_evicted_or_finishes() -> None:
    engine, _ = make_engine()
    engine.submit(completion("a", n=3, presence_penalty=1.0, max_tokens=50))
    engine.submit(completion("b", frequency_penalty=1.0, max_tokens=3))
    engine.submit(completion("c", max_tokens=50))  # no penalty: no row
    for _ in range(6):
        engine.step()
    counts = engine.sampler.processors.counts
    assert "b" not in engine.sessions and "a" in engine.sessions
    assert counts.num_rows - counts.num_free == 3  # a's three samples
    engine.abort("a", AbortCause.CLIENT_DISCONNECT)
    assert counts.num_free == counts.num_rows
    assert all(s.penalty_row is None for s in engine.sessions["c"].sequences)


def test_a_drafted_row_counts_the_drafts_before_it_as_output() -> None:
    """Speculative decoding: the rows of one sequence, each after the drafts before it (`ahead`),
    are processed as one-token decoding would process them at that position."""
    s = seq([1], [2], frequency_penalty=1.0, presence_penalty=0.5, min_tokens=3,
            bad_words=[[3, 4]])
    processors = LogitsProcessors([EOS])
    out = processors(logits(*[[1.0] * 6] * 3), [s, s, s], [[], [3], [3, 2]])
    assert out[0, 2] == 1.0 - 1.5 and out[0, 3] == 1.0 and out[0, 4] == 1.0
    # After 3: it counts once, and 4 would complete the bad word.
    assert out[1, 3] == 1.0 - 1.5 and out[1, 4] == -math.inf and out[1, EOS] == -math.inf
    # After 3, 2: 2 counts twice, 4 is allowed again, min_tokens (3) is reached: EOS is not
    # banned.
    assert out[2, 2] == 1.0 - 2.5 and out[2, 4] == 1.0 and out[2, EOS] == 0.0
    # The sequence's own counts are unchanged: drafts join them only when emitted.
    assert processors(logits([1.0] * 6), [s])[0, 3] == 1.0
