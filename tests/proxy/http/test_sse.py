"""SSE framing: every event is lines that any client splits the same way."""

import orjson
from hypothesis import given
from hypothesis import strategies as st

from proxy.http.sse import sse_event, sse_json


@given(st.text())
def test_any_text_is_one_data_line_for_every_line_splitter(text: str) -> None:
    payload = sse_json({"text": text})
    # str.splitlines breaks on more than the SSE line ends (U+0085, U+2028, U+2029, \x1c-\x1e, ...).
    assert len(payload.decode().splitlines()) == 1
    assert orjson.loads(payload) == {"text": text}


def test_event_framing() -> None:
    event = sse_event({"a": "x\u2028y"}, "response.output_text.delta")
    assert event == b'event: response.output_text.delta\ndata: {"a":"x\\u2028y"}\n\n'
