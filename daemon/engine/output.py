"""The output path of one choice, the step's emit phase: its new tokens become text (held back
where a stop string may start), Deltas and the reason it ended.

A choice's `Output` is the half of it the scheduler never sees (its `Sequence` is the other:
daemon/engine/sequence.py). The update phase has already appended the tokens to the sequence
and found whether the last of them ends it (a stop token, whose text is never shown, or a
length); a stop string can still end it at any of them, and then the tokens after that one
were never the choice's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from daemon.engine.stops import StopMatcher
from ipc.records import Delta, FinishReason, TokenLogprob
from ipc.wire import ToProxy

if TYPE_CHECKING:
    from daemon.engine.echo import Echo
    from daemon.engine.sequence import Sequence


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


@dataclass(slots=True, eq=False)
class Output:
    detok: Detokenizer
    stops: StopMatcher
    echo: Echo | None = None  # its prompt, sent before its first token
    pieces: list[str] = field(default_factory=list)  # its text so far, joined at the end
    # Sampled ids (and their log-probabilities, when asked) whose text is not out yet.
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    started: bool = False  # a Delta of its generated tokens went out

    def text(self) -> str:
        return "".join(self.pieces)

    def push(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None,
             ended: FinishReason | None, records: list[ToProxy]) -> FinishReason | None:
        """Emits `seq`'s new `tokens` (the update phase appended them; `ended`: how their last
        ends it, if it does) into `records`; returns the reason it ended, if it did. Every id
        reaches the client once (a stop token's too, though not its text), so the ids summed
        over a stream equal usage.completion_tokens."""
        if self.echo is not None:  # the answer starts with the prompt
            records += self.echo.deltas(seq.rid, seq.index)
            self.echo = None
        # A stop token's text is never shown (`ended` is None but at a choice's end: first).
        shown = tokens[:-1] if ended is not None and ended is FinishReason.STOP else tokens
        if self.stops.stops:  # stop strings to match: most sequences have none
            text, used = self._through_stops(seq, shown, len(tokens))
            if self.stops.stopped:
                ended = FinishReason.STOP
                if used < len(tokens):  # the tokens after the stop string were never its own
                    del seq.token_ids[used - len(tokens):]
                    tokens = tokens[:used]
        else:
            text = ""
            for token in shown:
                text += self.detok.push(token)
        if ended is not None:
            text += self._final_text()
        pending = self.pending_ids
        pending += tokens
        if logprobs is not None:
            self.pending_logprobs += logprobs[:len(tokens)]
        if text or (ended is not None and pending):
            self.pieces.append(text)
            records.append(Delta(seq.rid, seq.index, text, pending,
                                 self.pending_logprobs if logprobs is not None else None,
                                 prompt_tokens=0 if self.started else seq.num_prompt_tokens))
            self.started = True
            self.pending_ids = []
            if logprobs is not None:
                self.pending_logprobs = []
        return ended

    def _through_stops(self, seq: Sequence, shown: list[int], count: int) -> tuple[str, int]:
        """The text of `shown`, the first of the sequence's `count` new tokens, up to a stop
        string, and how many tokens that took (`count` if no stop string ended it)."""
        detok, stops = self.detok, self.stops
        text = ""
        for i, token in enumerate(shown):
            # The tokens generated up to this one: before min_tokens a stop is let through.
            generated = seq.num_generated - count + i + 1
            text += stops.push(detok.push(token), generated >= seq.params.min_tokens)
            if stops.stopped:
                return text, i + 1
        return text, count

    def _final_text(self) -> str:
        """Text held back by the detokenizer and the stop matcher, at the end of a choice."""
        stops = self.stops
        text = stops.push(self.detok.flush())
        return text if stops.stopped else text + stops.flush()
