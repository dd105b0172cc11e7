"""Logging for the three commands: JSON lines for machines, readable text for people.

``log_format=auto`` picks JSON when stderr is not a terminal or when systemd's journal holds it
(JOURNAL_STREAM), text on a terminal. Per-request records go to the ``tether.requests`` logger
with ``extra={"fields": {...}}``; the fields become top-level JSON keys or ``key=value`` pairs:

    logging.getLogger("tether.requests").info(
        "request finished", extra={"fields": {"rid": rid, "finish_reason": "abort", ...}})
"""

from __future__ import annotations

import enum
import logging
import logging.config
import os
import sys
import time
from typing import Any, TextIO

import orjson

from tether.settings import Settings

REQUESTS_LOGGER = "tether.requests"
LEVELS = ("debug", "info", "warning", "error")

# syslog priorities: journald strips a leading "<N>" and files the line under that priority,
# so `journalctl -p warning` works on our JSON lines too.
_SYSLOG_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
                    logging.CRITICAL: 2}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


def _timestamp(created: float) -> str:
    ms = int(created * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{ms:03d}Z"


class JsonFormatter(logging.Formatter):
    def __init__(self, component: str, syslog_prefix: bool = False) -> None:
        super().__init__()
        self.component = component
        self.syslog_prefix = syslog_prefix

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _timestamp(record.created),
            "level": record.levelname.lower(),
            "component": self.component,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in _fields(record).items():
            # The fixed keys keep their meaning for log queries; a colliding field is renamed.
            out[key if key not in out else f"field_{key}"] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        line = orjson.dumps(out, default=str).decode()
        if self.syslog_prefix:
            return f"<{_SYSLOG_PRIORITY.get(record.levelno, 6)}>{line}"
        return line


def _text_value(value: object) -> str:
    text = str(value.value if isinstance(value, enum.Enum) else value)
    if text == "" or any(c in text for c in ' "=\n\t'):
        return orjson.dumps(text).decode()
    return text


class TextFormatter(logging.Formatter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        clock = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = (f"{clock}.{int(record.msecs):03d} {record.levelname:<7} {self.component}: "
                f"{record.getMessage()}")
        pairs = " ".join(f"{k}={_text_value(v)}" for k, v in _fields(record).items())
        if pairs:
            line = f"{line} {pairs}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


def stream_is_journal(stream: TextIO) -> bool:
    """True when `stream` is the journald stream systemd connected (JOURNAL_STREAM=dev:inode)."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return expected == f"{st.st_dev}:{st.st_ino}"


def choose_format(log_format: str, stream: TextIO) -> str:
    if log_format != "auto":
        return log_format
    if os.environ.get("JOURNAL_STREAM") or not stream.isatty():
        return "json"
    return "text"


def config(log_format: str, log_level: str, component: str,
           stream: TextIO | None = None) -> dict[str, Any]:
    """A `logging.config.dictConfig` dict: every logger through one handler on the root logger.

    With no `stream` it writes to stderr and is plain JSON, so another process can take it (a
    tensor-parallel rank, which shares this process's stderr: "auto" is decided here for it).
    """
    if log_level not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, got {log_level!r}")
    out = sys.stderr if stream is None else stream
    if choose_format(log_format, out) == "json":
        formatter = {"()": f"{__name__}.JsonFormatter", "component": component,
                     "syslog_prefix": stream_is_journal(out)}
    else:
        formatter = {"()": f"{__name__}.TextFormatter", "component": component}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"tether": formatter},
        "handlers": {"tether": {"class": "logging.StreamHandler", "formatter": "tether",
                                "stream": "ext://sys.stderr" if stream is None else stream}},
        "root": {"handlers": ["tether"], "level": log_level.upper()},
        # uvicorn installs its own handlers unless told not to; let its records reach ours.
        "loggers": {name: {"handlers": [], "propagate": True}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
    }


def setup(settings: Settings, component: str, stream: TextIO | None = None) -> None:
    """Configure this process's logging (call once, first thing)."""
    logging.config.dictConfig(config(settings.log_format, settings.log_level, component, stream))
