"""The paged-cache decoder against transformers' reference Llama (fp32, max abs diff 1e-4), on
both paths: the CPU kernels (`kernels="auto"`, the default here) and the torch reference
modules (`kernels="torch"`, what CUDA runs around its attention kernel)."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from daemon.model.config import ModelConfig
from daemon.model.decoder import DecoderLM
from daemon.model.loader import init_random_, load_model
from daemon.model.runner import ModelRunner, ScheduledChunk
from tests.support.checkpoints import VOCAB

TOL = 1e-4
BS = 16
Checkpoint = Callable[..., tuple[Path, Any]]  # (directory, transformers model)


def reference_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


class Seq:
    """Test-side bookkeeping of one sequence: its tokens, blocks and cached length."""

    def __init__(self, ids: list[int], blocks: list[int]) -> None:
        self.ids, self.blocks, self.cached = ids, blocks, 0

    def chunk(self, n: int | None = None) -> ScheduledChunk:
        n = len(self.ids) - self.cached if n is None else n
        chunk = ScheduledChunk(self.ids[self.cached : self.cached + n], self.cached,
                               self.blocks, self.cached + n == len(self.ids))
        self.cached += n
        return chunk


def make_seqs(lengths: list[int], num_blocks: int = 64, seed: int = 0) -> list[Seq]:
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered physical blocks: the block table must be honoured
    seqs = []
    for n in lengths:
        blocks = [free.pop() for _ in range(4)]
        seqs.append(Seq([rng.randrange(2, VOCAB) for _ in range(n)], blocks))
    return seqs


KERNELS = pytest.mark.parametrize("kernels", ["auto", "torch"])


def load(path: Path, kernels: str = "auto") -> ModelRunner:
    loaded = load_model(str(path), "cpu", torch.float32, kernels=kernels)
    assert loaded.kernels == ("cpu" if kernels == "auto" else "torch")
    return ModelRunner(loaded.model, loaded.config, num_blocks=64)


@pytest.mark.parametrize("rope", ["none", "llama3", "linear"])
@pytest.mark.parametrize("tie", [False, True])
@KERNELS
def test_prefill_logits_match_transformers(llama_checkpoint: Checkpoint, rope: str,
                                           tie: bool, kernels: str) -> None:
    path, hf = llama_checkpoint(rope, tie)
    runner = load(path, kernels)
    seqs = make_seqs([37, 5, 60])
    logits = runner.run([s.chunk() for s in seqs])
    assert logits.dtype == torch.float32 and logits.shape == (3, VOCAB)
    for row, seq in zip(logits, seqs, strict=True):
        assert (row - reference_logits(hf, seq.ids)[-1]).abs().max() <= TOL


@pytest.mark.parametrize("rope", ["none", "llama3"])
@KERNELS
def test_batched_decode_matches_every_position(llama_checkpoint: Checkpoint, rope: str,
                                               kernels: str) -> None:
    path, hf = llama_checkpoint(rope, False)
    runner = load(path, kernels)
    seqs = make_seqs([3, 15, 16, 33], seed=1)  # decodes cross block boundaries
    prompt_lens = [len(s.ids) for s in seqs]
    runner.run([s.chunk() for s in seqs])
    rng = random.Random(2)
    for _ in range(20):
        for s in seqs:
            s.ids.append(rng.randrange(2, VOCAB))
        logits = runner.run([s.chunk() for s in seqs])
        for row, seq in zip(logits, seqs, strict=True):
            assert (row - reference_logits(hf, seq.ids)[-1]).abs().max() <= TOL
    assert [len(s.ids) for s in seqs] == [n + 20 for n in prompt_lens]


@KERNELS
def test_mixed_prefill_chunks_and_decodes_in_one_run(llama_checkpoint: Checkpoint,
                                                     kernels: str) -> None:
    path, hf = llama_checkpoint("llama3", False)
    runner = load(path, kernels)
    decoding, resumed, fresh, silent = make_seqs([20, 40, 25, 30], seed=3)
    runner.run([decoding.chunk(), resumed.chunk(17)])
    decoding.ids.append(7)
    # Order deliberately interleaves kinds; a chunk without logits sits in the middle.
    chunks = [fresh.chunk(), decoding.chunk(), silent.chunk(12), resumed.chunk()]
    logits = runner.run(chunks)
    assert logits.shape == (3, VOCAB)
    for row, seq in zip(logits, [fresh, decoding, resumed], strict=True):
        assert (row - reference_logits(hf, seq.ids)[-1]).abs().max() <= TOL


@KERNELS
def test_chunked_prefill_then_decode(llama_checkpoint: Checkpoint, kernels: str) -> None:
    path, hf = llama_checkpoint("none", True)
    runner = load(path, kernels)
    (seq,) = make_seqs([50], seed=4)
    for size in (5, 11, 16, 1):
        assert runner.run([seq.chunk(size)]).shape == (0, VOCAB)
    last = runner.run([seq.chunk()])
    assert (last[0] - reference_logits(hf, seq.ids)[-1]).abs().max() <= TOL
    seq.ids.append(9)
    step = runner.run([seq.chunk()])
    assert (step[0] - reference_logits(hf, seq.ids)[-1]).abs().max() <= TOL


@KERNELS
def test_greedy_generation_matches_transformers_generate(llama_checkpoint: Checkpoint,
                                                         kernels: str) -> None:
    path, hf = llama_checkpoint("llama3", True)
    runner = load(path, kernels)
    seqs = make_seqs([6, 19, 31], seed=5)
    prompts = [list(s.ids) for s in seqs]
    chunks = [s.chunk() for s in seqs]
    for _ in range(24):
        next_ids = runner.run(chunks).argmax(dim=-1).tolist()
        for s, token in zip(seqs, next_ids, strict=True):
            s.ids.append(token)
        chunks = [s.chunk() for s in seqs]
    for prompt, seq in zip(prompts, seqs, strict=True):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        assert seq.ids == out[0].tolist()


@KERNELS
def test_copy_block_forks_a_sequence(llama_checkpoint: Checkpoint, kernels: str) -> None:
    path, hf = llama_checkpoint("none", False)
    runner = load(path, kernels)
    (parent,) = make_seqs([21], seed=6)  # second block partially filled
    runner.run([parent.chunk()])
    child = Seq(list(parent.ids), [parent.blocks[0], 60])
    child.cached = parent.cached
    runner.copy_block(parent.blocks[1], 60)
    parent.ids.append(11)
    child.ids.append(12)
    logits = runner.run([parent.chunk(), child.chunk()])
    for row, seq in zip(logits, [parent, child], strict=True):
        assert (row - reference_logits(hf, seq.ids)[-1]).abs().max() <= TOL


def test_run_rejects_a_short_block_table(llama_checkpoint: Checkpoint) -> None:
    path, _ = llama_checkpoint("none", False)
    runner = load(path)
    with pytest.raises(ValueError, match="chunk 1: block_table has 1 blocks"):
        runner.run([ScheduledChunk([5], 0, [0], True),
                    ScheduledChunk(list(range(2, 20)), 0, [1], True)])
    with pytest.raises(ValueError, match=r"outside 0\.\.63"):
        runner.run([ScheduledChunk([5], 0, [64], True)])


def test_run_without_chunks_returns_no_logits(llama_checkpoint: Checkpoint) -> None:
    path, _ = llama_checkpoint("none", False)
    assert load(path).run([]).shape == (0, VOCAB)


@KERNELS
def test_bfloat16_is_as_close_to_float32_as_transformers_in_bfloat16(
        llama_checkpoint: Checkpoint, kernels: str) -> None:
    path, hf = llama_checkpoint("none", False)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    loaded = load_model(str(path), "cpu", torch.bfloat16, kernels=kernels)
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=8)
    assert runner.kv_caches[0].dtype == torch.bfloat16
    (seq,) = make_seqs([30], num_blocks=8, seed=7)
    prompt_len = len(seq.ids)
    ours = [runner.run([seq.chunk()])[0]]
    for token in (5, 9, 17):  # decodes read the bf16 cache back
        seq.ids.append(token)
        ours.append(runner.run([seq.chunk()])[0])
    assert ours[0].dtype == torch.float32
    for i, row in enumerate(ours):
        ids = seq.ids[: prompt_len + i]
        exact, theirs = reference_logits(hf, ids)[-1], reference_logits(hf16, ids)[-1]
        assert (row - theirs).abs().max() <= 2 * (theirs - exact).abs().max() + 1e-3


# Random Gaussian weights in 4 bits keep ~8% error each (a step of ~(4 sigma) / 15): the KL
# of that is ~0.26 nats here; a kernel or packing that is wrong gives several.
@pytest.mark.parametrize(("quantization", "bound"), [("int8", 1e-2), ("int4", 0.5)])
def test_quantized_weights_stay_close_to_float32(llama_checkpoint: Checkpoint,
                                                 quantization: str, bound: float) -> None:
    path, hf = llama_checkpoint("none", False)
    loaded = load_model(str(path), "cpu", torch.float32, quantization=quantization)
    runner = ModelRunner(loaded.model, loaded.config, num_blocks=8)
    (seq,) = make_seqs([30], num_blocks=8, seed=7)
    logits = runner.run([seq.chunk()])[0]
    exact = reference_logits(hf, seq.ids)[-1]
    kl = (exact.log_softmax(-1).exp() * (exact.log_softmax(-1) - logits.log_softmax(-1))).sum()
    assert 0 < kl < bound


def test_vocab_limit_masks_padded_ids() -> None:
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16)
    model = DecoderLM(config, torch.device("cpu"), torch.float32, vocab_limit=50)
    init_random_(model, seed=0)
    runner = ModelRunner(model, config, num_blocks=4)
    logits = runner.run([ScheduledChunk([1, 2, 3], 0, [0], True)])
    assert torch.isinf(logits[0, 50:]).all() and torch.isfinite(logits[0, :50]).all()


def test_builtin_tiny_is_deterministic_and_varied() -> None:
    first, second = load_model("builtin:tiny"), load_model("builtin:tiny")
    assert first.max_model_len == 2048 and first.name == "builtin:tiny"
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)
    runner = ModelRunner(first.model, first.config, num_blocks=16)
    ids = first.tokenizer.encode("Once upon a time")
    seq = Seq(ids, list(range(8)))
    gen = torch.Generator().manual_seed(0)
    sampled = []
    for _ in range(40):
        probs = runner.run([seq.chunk()]).softmax(dim=-1)
        token = int(torch.multinomial(probs[0], 1, generator=gen))
        sampled.append(token)
        seq.ids.append(token)
    assert len(set(sampled)) >= 10
    assert max(sampled) < first.tokenizer.vocab_size


def test_blocks_for_budget_matches_the_allocated_cache() -> None:
    loaded = load_model("builtin:tiny", "cpu", "float32")
    blocks = ModelRunner.blocks_for_budget(loaded.config, 64 << 20, torch.float32)
    runner = ModelRunner(loaded.model, loaded.config, blocks)
    used = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    assert used <= 64 << 20
    assert used + used // blocks > 64 << 20  # one more block would not fit
