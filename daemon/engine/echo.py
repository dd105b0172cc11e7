"""Completions' `echo`: each choice's answer starts with its prompt, and with logprobs with the
model's log-probability of each prompt token given the tokens before it (vLLM's prompt
logprobs; the first token has none, which OpenAI and vLLM show as null).

Those need the logits at every prompt position, not only the last: the scheduler marks the
prompt chunks of a sequence whose echo is not complete (`ScheduledChunk.all_logits`), the runner
returns a row per token of such a chunk, and the sampler's `prompt_logprobs` takes the entries
the tick's rows give.
Such a sequence reads nothing from the prefix cache (a cached position was never computed
here), and a prompt recomputed after a preemption only adds the entries still missing. One
`Echo` serves a prompt's n samples: each sends it before its first generated token, then lets
it go.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from daemon.model.tokenizer import Tokenizer
from ipc.records import ECHO_TOKENS, Delta, Submit, TokenLogprob


@dataclass(slots=True, eq=False)
class Echo:
    text: str
    token_ids: list[int]
    num_logprobs: int | None  # alternatives per prompt token; None: no log-probabilities
    # One per prompt token so far; the first's value is a placeholder (records.Delta).
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.num_logprobs is None or len(self.logprobs) >= len(self.token_ids)

    def deltas(self, rid: str, index: int) -> list[Delta]:
        """The prompt for one choice: its text and ids, then its log-probabilities, in Deltas
        of at most ECHO_TOKENS entries."""
        if self.num_logprobs is None:
            return [Delta(rid, index, self.text, self.token_ids, prompt=True)]
        return [Delta(rid, index, "" if at else self.text, [] if at else self.token_ids,
                      self.logprobs[at : at + ECHO_TOKENS], prompt=True)
                for at in range(0, len(self.logprobs), ECHO_TOKENS)]


def make_echoes(submit: Submit, prompts: list[list[int]],
                tokenizer: Tokenizer) -> list[Echo | None]:
    """Per prompt, what its choices echo: the prompt as the client wrote it, or its ids decoded."""
    params = submit.sampling
    if not params.echo:
        return [None] * len(prompts)
    texts = submit.prompts or [tokenizer.decode(ids) for ids in submit.prompt_ids]
    echoes: list[Echo | None] = []
    for text, ids in zip(texts, prompts, strict=True):
        echo = Echo(text, ids, params.logprobs)
        if params.logprobs is not None:
            echo.logprobs.append(TokenLogprob(tokenizer.token_bytes(ids[0]), 0.0))
        echoes.append(echo)
    return echoes
