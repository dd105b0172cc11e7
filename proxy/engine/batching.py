"""Merging the Deltas a stream's reader found waiting for it (``--stream-merge-tokens``).

A reader that keeps up finds one record per tick and sends it as one event. One that fell behind
(a slow client, a busy proxy) finds several; they always go out in one socket write, and with
merging on, each sequence's consecutive Deltas become one Delta of up to that many tokens: the
client gets the same text, token ids and log-probabilities, in the same order, in fewer events.
"""

from __future__ import annotations

from ipc.records import Delta, Finish

Batch = list[Delta | Finish]


def merge_deltas(batch: Batch, max_tokens: int) -> Batch:
    """Each sequence's Deltas in `batch` joined, in order, into Deltas of at most `max_tokens`
    tokens (one longer than that stays whole). A merged Delta takes the place of its first part;
    a Finish ends its sequence's run, so nothing moves across it."""
    if len(batch) < 2:
        return batch
    out: list[Delta | Finish | list[Delta]] = []
    runs: dict[int, tuple[list[Delta], int]] = {}  # sequence index -> its open run, tokens in it
    for record in batch:
        if type(record) is Delta and not record.prompt:
            run = runs.get(record.index)
            size = len(record.token_ids)
            if run is not None and run[1] + size <= max_tokens:
                run[0].append(record)
                runs[record.index] = (run[0], run[1] + size)
            else:
                parts = [record]
                runs[record.index] = (parts, size)
                out.append(parts)
        else:  # nothing joins across a Finish, nor a prompt's echo
            runs.pop(record.index, None)
            out.append(record)
    return [joined(item) if isinstance(item, list) else item for item in out]


def joined(parts: list[Delta]) -> Delta:
    """One Delta carrying `parts` (Deltas of one sequence, in order)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    logprobs = None if first.logprobs is None else [
        lp for part in parts for lp in part.logprobs or ()]
    return Delta(first.rid, first.index, "".join([part.text for part in parts]),
                 [token for part in parts for token in part.token_ids], logprobs,
                 prompt_tokens=first.prompt_tokens)
