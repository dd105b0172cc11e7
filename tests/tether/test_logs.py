from __future__ import annotations

import io
import logging
import logging.config
import os
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from ipc.records import AbortCause, FinishReason
from tether import logs
from tether.settings import Settings

REQUEST_FIELDS = {
    "rid": "chatcmpl-1", "kind": "chat", "finish_reason": FinishReason.ABORT,
    "abort_cause": AbortCause.CLIENT_DISCONNECT, "prompt_tokens": 12,
    "generated_tokens": 3, "duration_s": 0.25, "note": "two words",
}


@pytest.fixture(autouse=True)
def restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _log_request() -> None:
    logging.getLogger(logs.REQUESTS_LOGGER).info(
        "request finished", extra={"fields": REQUEST_FIELDS})


def test_json_lines_carry_request_fields_as_keys() -> None:
    out = io.StringIO()
    logs.setup(Settings(log_format="json"), "proxy", stream=out)
    _log_request()
    record = orjson.loads(out.getvalue())
    assert record["msg"] == "request finished"
    assert record["component"] == "proxy"
    assert record["level"] == "info"
    assert record["logger"] == "tether.requests"
    assert record["finish_reason"] == "abort"
    assert record["abort_cause"] == "client_disconnect"
    assert {k: record[k] for k in ("rid", "prompt_tokens", "generated_tokens", "duration_s")} == {
        "rid": "chatcmpl-1", "prompt_tokens": 12, "generated_tokens": 3, "duration_s": 0.25}


def test_text_lines_carry_request_fields_as_key_value_pairs() -> None:
    out = io.StringIO()
    logs.setup(Settings(log_format="text"), "daemon", stream=out)
    _log_request()
    line = out.getvalue().strip()
    assert "INFO" in line and "daemon: request finished" in line
    assert "rid=chatcmpl-1" in line
    assert "finish_reason=abort abort_cause=client_disconnect" in line
    assert "prompt_tokens=12 generated_tokens=3 duration_s=0.25" in line
    assert 'note="two words"' in line


def test_field_named_like_a_fixed_key_does_not_replace_it() -> None:
    out = io.StringIO()
    logs.setup(Settings(log_format="json"), "proxy", stream=out)
    logging.getLogger("tether.requests").info("hi", extra={"fields": {"msg": "other"}})
    record = orjson.loads(out.getvalue())
    assert (record["msg"], record["field_msg"]) == ("hi", "other")


def test_exceptions_are_kept_inside_one_json_line() -> None:
    out = io.StringIO()
    logs.setup(Settings(log_format="json"), "daemon", stream=out)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("tether.daemon").exception("tick failed")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert "RuntimeError: boom" in orjson.loads(lines[0])["exc"]


def test_level_filters_records() -> None:
    out = io.StringIO()
    logs.setup(Settings(log_format="json", log_level="warning"), "proxy", stream=out)
    logging.getLogger("tether.proxy").info("quiet")
    logging.getLogger("tether.proxy").warning("loud")
    assert [orjson.loads(x)["msg"] for x in out.getvalue().splitlines()] == ["loud"]


def test_auto_is_text_on_a_terminal_and_json_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    primary, secondary = os.openpty()
    with open(secondary, "w", closefd=True) as tty:
        assert logs.choose_format("auto", tty) == "text"
        monkeypatch.setenv("JOURNAL_STREAM", "8:1234")
        assert logs.choose_format("auto", tty) == "json"
        assert logs.choose_format("text", tty) == "text"
    os.close(primary)
    assert logs.choose_format("auto", io.StringIO()) == "json"


def test_journal_stream_gets_syslog_priorities(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open(tmp_path / "journal", "w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        logs.setup(Settings(), "daemon", stream=stream)
        logging.getLogger("tether.daemon").warning("careful")
        logging.getLogger("tether.daemon").info("fine")
    lines = (tmp_path / "journal").read_text().splitlines()
    assert [line[:4] for line in lines] == ["<4>{", "<6>{"]
    assert orjson.loads(lines[0][3:])["msg"] == "careful"


def test_bad_log_level_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--log-level"):
        logs.setup(Settings(log_level="loud"), "proxy", stream=io.StringIO())


def test_a_config_for_another_process_travels_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    config = logs.config("text", "warning", "daemon rank 1")
    logging.config.dictConfig(orjson.loads(orjson.dumps(config)))  # as a rank receives it
    logging.getLogger("tether.daemon").info("not shown")
    logging.getLogger("tether.daemon").warning("rank 1 stops")
    assert capsys.readouterr().err.strip().endswith("WARNING daemon rank 1: rank 1 stops")
