import pytest
import torch

from daemon.engine.sampler import Sampler, seed_for
from daemon.engine.sequence import Sequence
from daemon.model.tokenizer import ByteTokenizer
from ipc.records import SamplingParams

TOK = ByteTokenizer()
VOCAB = 64
EOS = 7


def seq(index: int = 0, seed: int | None = None, generated: int = 0, **params) -> Sequence:
    s = Sequence("r", index, [1, 2, 3], SamplingParams(**params),
                 seed=None if seed is None else seed_for(seed, index))
    s.token_ids += [5] * generated
    return s


def flat_logits(rows: int) -> torch.Tensor:
    return torch.zeros(rows, VOCAB)


def test_temperature_zero_is_greedy():
    logits = torch.randn(3, VOCAB)
    tokens = Sampler([EOS])(logits, [seq(temperature=0.0) for _ in range(3)])
    assert tokens == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    def draws(batch_size: int, position: int) -> list[int]:
        sampler = Sampler([EOS])
        seqs = [seq(temperature=1.0) for _ in range(batch_size)]
        seeded = seq(seed=1234, temperature=1.0)
        seqs.insert(position, seeded)
        out = []
        for _ in range(5):
            out.append(sampler(flat_logits(len(seqs)), seqs)[position])
        return out

    assert draws(0, 0) == draws(4, 2) == draws(7, 7)
    assert len(set(draws(0, 0))) > 1


def test_different_samples_of_one_seed_differ():
    sampler = Sampler([EOS])
    a, b = seq(0, seed=1, temperature=1.0), seq(1, seed=1, temperature=1.0)
    draws = [sampler(flat_logits(2), [a, b]) for _ in range(6)]
    assert [d[0] for d in draws] != [d[1] for d in draws]


def test_top_k_keeps_only_the_k_best():
    logits = torch.arange(VOCAB, dtype=torch.float32).repeat(200, 1)
    tokens = Sampler([EOS])(logits, [seq(temperature=2.0, top_k=3) for _ in range(200)])
    assert set(tokens) <= {VOCAB - 1, VOCAB - 2, VOCAB - 3}
    assert len(set(tokens)) == 3


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.full((300, VOCAB), -10.0)
    logits[:, 10] = 2.0  # ~0.66 of the mass
    logits[:, 11] = 1.3  # ~0.33
    tokens = Sampler([EOS])(logits, [seq(temperature=1.0, top_p=0.5) for _ in range(300)])
    assert set(tokens) == {10}
    tokens = Sampler([EOS])(logits, [seq(temperature=1.0, top_p=0.9) for _ in range(300)])
    assert set(tokens) == {10, 11}


def test_mixed_batch_applies_each_rows_parameters():
    logits = torch.arange(VOCAB, dtype=torch.float32).repeat(2, 1)
    greedy, limited = seq(temperature=0.0), seq(temperature=2.0, top_k=1)
    assert Sampler([EOS])(logits, [greedy, limited]) == [VOCAB - 1, VOCAB - 1]


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 100.0
    logits[0, 9] = 50.0
    logits[0, 3] = 10.0
    early = seq(temperature=0.0, min_tokens=2, stop_token_ids=[9], generated=1)
    assert Sampler([EOS])(logits, [early]) == [3]
    done = seq(temperature=0.0, min_tokens=2, stop_token_ids=[9], generated=2)
    assert Sampler([EOS])(logits, [done]) == [EOS]


def test_ignore_eos_leaves_eos_to_min_tokens_rules():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 100.0
    s = seq(temperature=0.0, min_tokens=3, ignore_eos=True)
    # ignore_eos means EOS does not end the sequence; it is not masked.
    assert Sampler([EOS])(logits, [s]) == [EOS]


def test_only_the_sampled_ids_are_read_back(monkeypatch):
    """On a GPU every value read on the host waits for the device: a tick reads the ids once
    (which rows are greedy is known on the host), and never writes into the runner's logits."""
    reads: list[str] = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):
            reads.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    logits = torch.randn(4, VOCAB)
    before = logits.clone()
    seqs = [seq(temperature=0.0), seq(temperature=0.8, top_p=0.9), seq(temperature=0.0),
            seq(temperature=1.0, min_tokens=3, top_k=5)]
    Sampler([EOS])(logits, seqs)
    assert reads == ["tolist"]
    assert torch.equal(logits, before)


def test_unseeded_rows_draw_each_token_with_its_probability_and_never_a_banned_one():
    """One uniform draw a row, through the row's cumulative distribution (sampler._draw)."""
    rows = 20_000
    probs = torch.tensor([0.1, 0.2, 0.0, 0.6, 0.0, 0.1])
    logits = probs.log().repeat(rows, 1)  # log 0 = -inf: a banned token
    seqs = [seq(i) for i in range(rows)]
    tokens = torch.tensor(Sampler([EOS])(logits, seqs))
    freq = torch.bincount(tokens, minlength=len(probs)) / rows
    assert freq[2] == 0 and freq[4] == 0
    assert torch.allclose(freq, probs, atol=0.015)


def test_a_plain_batch_draws_what_the_full_path_draws():
    """A batch where nobody asks for anything but a draw skips the per-row passes: same tokens
    as the full path from the same random state."""
    logits = torch.randn(32, VOCAB)
    seqs = [seq(i) for i in range(32)]
    assert all(s.plain_draw for s in seqs)
    torch.manual_seed(3)
    plain = Sampler([EOS])(logits, seqs)
    for s in seqs:
        s.plain_draw = False
    torch.manual_seed(3)
    assert Sampler([EOS])(logits, seqs) == plain


@pytest.mark.parametrize(("params", "held"), [
    ({"temperature": 0.7}, {}), ({"temperature": 0.0}, {}), ({"top_p": 0.9}, {}),
    ({"top_k": 5}, {}), ({"min_p": 0.1}, {}), ({"min_tokens": 2}, {}),
    ({"logit_bias": {3: 1.0}}, {}), ({"logprobs": 0}, {}), ({"presence_penalty": 0.5}, {}),
    ({"frequency_penalty": 0.5}, {}), ({"repetition_penalty": 1.1}, {}),
    ({}, {"seed": 1}), ({}, {"bad_words": [[120]]})])
def test_any_sampling_field_takes_the_full_path(params, held):
    s = Sequence("r", 0, [1, 2, 3], SamplingParams(**params), **held)
    assert not s.plain_draw


@pytest.mark.parametrize("params", [
    {"temperature": 5e-324}, {"temperature": 1e-40, "seed": 3},
    {"repetition_penalty": 5e-324, "temperature": 1.0},
    {"repetition_penalty": 1e38, "temperature": 0.7},
])
def test_parameters_past_float32_never_give_a_token_outside_the_vocabulary(params):
    """A temperature or a repetition penalty that float32 rounds to 0 or to infinity (the
    edge takes any positive number) still gives a token of the vocabulary: the fuzzer's
    repetition_penalty 5e-324 once picked id 260 of 260."""
    seed = params.pop("seed", None)
    sampler = Sampler([EOS])
    seqs = [seq(seed=seed, **params) for _ in range(4)]
    for s in seqs:
        s.token_ids += list(range(VOCAB))  # every token seen: every logit penalised
    logits = torch.randn(4, VOCAB) * 5
    sampler.count(seqs, [list(range(VOCAB))] * 4)
    for _ in range(5):
        tokens = sampler(logits, seqs)
        assert all(0 <= t < VOCAB for t in tokens), tokens
