"""Driving an engine in tests: a fake-runner engine, request builders, record readers."""

from __future__ import annotations

import time

from daemon.engine.core import Engine
from daemon.engine.grammar import Grammars
from daemon.engine.guided import Guidance
from daemon.engine.speculative import NgramConfig
from daemon.model.tokenizer import ByteTokenizer, Tokenizer
from daemon.responses.store import ResponseStore
from ipc.records import Delta, Finish, RequestKind, SamplingParams, Submit
from ipc.wire import ToProxy
from tests.support.fake_runner import FakeRunner, Script

TOK = ByteTokenizer()
EOS = TOK.eos_token_ids[0]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def make_engine(script: Script | None = None, num_blocks: int = 64, max_num_seqs: int = 8,
                budget: int = 64, max_model_len: int = 512,
                store: ResponseStore | None = None,
                prefix_caching: bool = True,
                guidance: Guidance | None = None,
                speculative: NgramConfig | None = None,
                tokenizer: Tokenizer = TOK) -> tuple[Engine, FakeRunner]:
    runner = FakeRunner(num_blocks, tokenizer.vocab_size, script)
    engine = Engine(runner, tokenizer, store, max_num_seqs, budget, max_model_len, "fake",
                    clock=Clock(), prefix_caching=prefix_caching, guidance=guidance,
                    speculative=speculative)
    return engine, runner


def guidance(tokenizer: Tokenizer = TOK) -> Guidance:
    """Constrained decoding over the byte tokenizer (or `tokenizer`), as the daemon builds it."""
    return Guidance(Grammars(tokenizer, tokenizer.special_token_ids))


def completion(rid: str, prompt: str = "hello", n: int = 1, **params) -> Submit:
    return Submit(rid, RequestKind.COMPLETION, SamplingParams(**params), n=n,
                  prompts=[prompt], epoch=1)


def run(engine: Engine, max_ticks: int = 500, timeout: float = 30.0) -> list[ToProxy]:
    """Ticks until the engine has nothing left and the store thread is quiet, as the server
    does: what the store thread and the grammar compiles hand back joins between ticks
    (waiting for them is not a tick)."""
    out: list[ToProxy] = []
    deadline = time.monotonic() + timeout
    ticks = 0
    while ticks < max_ticks:
        out += engine.from_store()
        out += engine.admit_guided()
        if not engine.has_work:
            store_busy = engine.responses is not None and engine.responses.busy
            if not (engine.waiting_for_grammar or engine.waiting_for_store or store_busy):
                return out
            assert time.monotonic() < deadline, "the engine waited too long for its threads"
            time.sleep(0.001)  # a grammar compiles, or the store works, on a thread
            continue
        out += engine.step()
        ticks += 1
    raise AssertionError("engine did not finish")


def settle(engine: Engine, timeout: float = 30.0) -> list[ToProxy]:
    """Waits until the store thread has done all it was told (no tick runs meanwhile); the
    records its answers make (an Error for a refused load, a stored turn's Finish)."""
    out: list[ToProxy] = []
    deadline = time.monotonic() + timeout
    while True:
        out += engine.from_store()
        if engine.responses is None or not engine.responses.busy:
            return out
        assert time.monotonic() < deadline, "the store thread did not finish"
        time.sleep(0.001)


def texts(records: list[ToProxy], rid: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for r in records:
        if isinstance(r, Delta) and r.rid == rid:
            out[r.index] = out.get(r.index, "") + r.text
    return out


def finishes(records: list[ToProxy], rid: str) -> dict[int, Finish]:
    return {r.index: r for r in records if isinstance(r, Finish) and r.rid == rid}
