"""What a request that does not stream holds: the same answer from compact arrays, and the bytes
a collected token costs, measured with tracemalloc against the figures the up-front check uses.

Measured on 4 choices x 400 tokens, per log-probability entry with 20 alternatives (chat /
completions): held once collected 22 / 22 bytes (137 / 137 when each token was a TokenLogprob
with a tuple per alternative); at the peak of answering 215 / 97 (684 / 358 when the whole
answer became Python objects, then one JSON string). Text alone: 12 held, 37 at the peak (102,
130 before).
"""

from __future__ import annotations

import gc
import random
import tracemalloc

import msgspec
import orjson
import pytest

from ipc.records import (
    Delta,
    Finish,
    FinishReason,
    SamplingParams,
    Submit,
    TokenLogprob,
    Usage,
)
from proxy.engine.collected import (
    LOGPROB_BYTES,
    LOGPROB_TOKEN_BYTES,
    SLICE_TOKENS,
    TOKEN_BYTES,
    Logprobs,
    collected_bytes,
)
from proxy.openai.completion_answer import CHAT, COMPLETION, CompletionAnswer, Shape, Wants

SHAPES = pytest.mark.parametrize("shape", [COMPLETION, CHAT], ids=["completion", "chat"])
# Tokens of a byte-level BPE: words, pieces of multi-byte characters, bytes alone.
SUN = "日本".encode()
VOCAB = [f" w{i}".encode() for i in range(3000)] + [SUN[:2], SUN[2:4], SUN[4:], b"\xe6", b"\n"]


def token_logprobs(rng: random.Random, count: int, k: int) -> list[TokenLogprob]:
    return [TokenLogprob(rng.choice(VOCAB), -rng.random() * 9,
                         [(rng.choice(VOCAB), -rng.random() * 9) for _ in range(k)])
            for _ in range(count)]


@SHAPES
@pytest.mark.parametrize("k", [0, 3, 20])
def test_a_collected_choice_renders_as_its_token_logprobs_do(shape: Shape, k: int) -> None:
    lps = token_logprobs(random.Random(k), 2 * SLICE_TOKENS + 7, k)
    store = Logprobs()
    for start in range(0, len(lps), 5):  # as Deltas bring them
        store.extend(lps[start:start + 5])
    assert orjson.loads(shape.logprobs_json(store)) == orjson.loads(
        orjson.dumps(shape.logprobs(lps, 0)))
    assert orjson.loads(shape.logprobs_json(Logprobs())) == shape.logprobs([], 0)


def measured(shape: Shape, seqs: int, tokens: int, k: int | None) -> tuple[int, int]:
    """(bytes held once collected, bytes at the peak of answering), as the proxy gets its
    records: decoded from the wire, one Delta a token."""
    rng = random.Random(seqs)
    encode = msgspec.msgpack.encode
    frames = []
    for _ in range(tokens):
        for i in range(seqs):
            lps = None if k is None else token_logprobs(rng, 1, k)
            frames.append(encode(Delta("cmpl-x", i, rng.choice(VOCAB).decode(errors="replace"),
                                       [rng.randrange(50000)], lps)))
    decoder = msgspec.msgpack.Decoder(Delta)
    submit = Submit("cmpl-x", shape.kind, SamplingParams(max_tokens=tokens, logprobs=k),
                    n=seqs, prompts=["p"])
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        answer = CompletionAnswer(submit, shape, "m", Wants(False, False, True))
        for frame in frames:
            answer.collect([decoder.decode(frame)])
        answer.collect([Finish("cmpl-x", i, FinishReason.LENGTH, Usage(1, tokens))
                        for i in range(seqs)])
        held = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.reset_peak()
        body = orjson.dumps(answer.body())
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert len(orjson.loads(body)["choices"]) == seqs
    return held, peak


@SHAPES
@pytest.mark.parametrize(("seqs", "tokens"), [(1, 2 * SLICE_TOKENS), (6, 100)])
@pytest.mark.parametrize("k", [None, 0, 20])
def test_the_bytes_a_collected_token_costs_are_within_the_estimate(
        shape: Shape, seqs: int, tokens: int, k: int | None) -> None:
    # Per token, what twice the tokens add: a rendering's fixed costs (orjson's buffer, a
    # slice's objects) are the same for both.
    held, peak = measured(shape, seqs, tokens, k)
    held2, peak2 = measured(shape, seqs, 2 * tokens, k)
    per_held, per_peak = ((b - a) / (seqs * tokens) for a, b in ((held, held2), (peak, peak2)))
    entries = 0 if k is None else 1 + k
    print(f"{shape.endpoint} n={seqs} logprobs={k}: held {per_held:.0f} B/token, "
          f"peak {per_peak:.0f} B/token + {(peak - per_peak * seqs * tokens) / 2**20:.1f} MiB")
    assert per_peak <= collected_bytes(1, 1, k)
    assert peak - per_peak * seqs * tokens < 4 * 2**20
    # Collecting is cheap: the text, its id, and per entry its value, its end and its bytes.
    assert per_held <= 24 + entries * 24
    assert collected_bytes(1, 1, k) == TOKEN_BYTES + (
        0 if k is None else LOGPROB_TOKEN_BYTES + entries * LOGPROB_BYTES)
