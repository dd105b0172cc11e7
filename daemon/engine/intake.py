"""What a Submit becomes in the engine: its prompts rendered and checked against the server's
limits, its sequences and their outputs built, its session.

Apart from the engine (daemon/engine/core.py) because a stored Responses turn's prompts are
rendered on the store thread (daemon/engine/stored.py): `prompts` reads nothing the tick
changes, so either thread may call it.
"""

from __future__ import annotations

from collections.abc import Callable

from daemon.engine.admission import Built, build_sequences, check_limits, check_sequences
from daemon.engine.block_manager import BlockManager
from daemon.engine.output import Detokenizer
from daemon.engine.session import Session
from daemon.model.tokenizer import Tokenizer
from daemon.prompts import History, max_token_bytes, render_prompts
from daemon.rejected import ContextBytes
from ipc.records import RequestKind, Submit


def _default_detokenizer(tokenizer: Tokenizer) -> Callable[[list[int]], Detokenizer]:
    from daemon.model.tokenizer import incremental_detokenizer

    return lambda prompt_ids: incremental_detokenizer(tokenizer, prompt_ids)


class Intake:
    def __init__(self, tokenizer: Tokenizer, block_manager: BlockManager, max_num_seqs: int,
                 max_model_len: int, clock: Callable[[], float], *,
                 make_detokenizer: Callable[[list[int]], Detokenizer] | None = None,
                 max_seqs_per_request: int | None = None, stores: bool = False) -> None:
        self.tokenizer = tokenizer
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_seqs_per_request = max_seqs_per_request  # None: only n <= max_num_seqs
        self.max_model_len = max_model_len
        # The most text a prompt that fits can hold: what a longer one is refused by, untokenized.
        self.context_bytes = ContextBytes(max_model_len, max_token_bytes(tokenizer))
        self.clock = clock
        self.make_detok = make_detokenizer or _default_detokenizer(tokenizer)
        self.stores = stores  # a response store is there: Responses turns may hold placeholders

    def prompts(self, rec: Submit, history: History | None) -> list[list[int]]:
        """A request's prompts, or Rejected (on the store thread for a stored turn's: it may
        not change the engine)."""
        prompts = render_prompts(rec, self.tokenizer, history, self.context_bytes)
        check_sequences(rec, self.max_num_seqs, self.max_seqs_per_request)
        check_limits(rec, prompts, self.max_model_len, self.block_manager,
                     self.tokenizer.vocab_size)
        return prompts

    def build(self, rec: Submit, prompts: list[list[int]]) -> Built:
        return build_sequences(rec, prompts, self.make_detok, self.tokenizer,
                               self.max_model_len, self.block_manager)

    def session(self, rec: Submit, built: Built) -> Session:
        """A request's session (a loading turn's without sequences yet: until its load says,
        it may hold a placeholder)."""
        session = Session(rid=rec.rid, epoch=rec.epoch, kind=rec.kind, sequences=built[0],
                          outputs=built[1], t_arrival=self.clock(), client_id=rec.client_id)
        fields = rec.response
        if rec.kind is RequestKind.RESPONSE and fields is not None and self.stores:
            session.background = fields.background
            session.placeholder = fields.store or fields.background
        return session
