"""A plain delta spliced into its choice's pre-rendered bytes is byte for byte the event that
dumping the whole chunk gives, whatever the text."""

from __future__ import annotations

from typing import Any

import pytest

from ipc.records import Delta, Finish, FinishReason, Usage
from proxy.http.sse import sse_json
from proxy.openai.chunks import StreamChunks
from proxy.openai.completion_answer import CHAT, COMPLETION, Shape

TEXTS = ["a", 'quote " and \\ back', "line\u2028sep\x85and\u2029para", "caf\u00e9 \U0001f389",
         "\x00\x01\x1f controls", "\n\r\t", "\x00text\x00", "</script>"]


def dumped(shape: Shape, head: dict[str, Any], index: int, text: str, first: bool,
           ids: list[int] | None, include_usage: bool) -> bytes:
    choice = shape.chunk_choice(index, text, None, first)
    if ids is not None:
        choice["token_ids"] = ids
    chunk = {**head, "choices": [choice], **({"usage": None} if include_usage else {})}
    return b"data: " + sse_json(chunk) + b"\n\n"


@pytest.mark.parametrize("shape", [COMPLETION, CHAT], ids=["completion", "chat"])
@pytest.mark.parametrize("token_ids", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_every_delta_is_the_dumped_chunk(shape: Shape, token_ids: bool,
                                         include_usage: bool) -> None:
    head = {"id": "cmpl-1", "object": shape.chunk_object, "created": 7,
            "model": "m\u2028odel \"x\""}
    chunks = StreamChunks(shape, head, include_usage, token_ids)
    for index in (0, 3):
        for k, text in enumerate(TEXTS):
            ids = [k, 100 + k]
            got = chunks.delta(Delta("r", index, text, ids))
            assert got == dumped(shape, head, index, text, k == 0, ids if token_ids else None,
                                 include_usage), (index, text)
    finish = chunks.finish(Finish("r", 0, FinishReason.LENGTH, Usage(1, 1)), "length")
    choice = shape.chunk_choice(0, "", "length", False)
    assert finish == b"data: " + sse_json(
        {**head, "choices": [choice], **({"usage": None} if include_usage else {})}) + b"\n\n"


def test_an_empty_delta_renders_as_its_chunk() -> None:
    # A token that ends inside a character has no text yet: chat leaves "content" out.
    head = {"id": "c", "object": CHAT.chunk_object, "created": 1, "model": "m"}
    chunks = StreamChunks(CHAT, head, False, False)
    chunks.delta(Delta("r", 0, "a", [1]))
    assert chunks.delta(Delta("r", 0, "", [2])) == dumped(CHAT, head, 0, "", False, None, False)
