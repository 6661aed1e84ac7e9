"""Log output for ``meshgate serve`` and ``meshgate node``: text lines, or one JSON object per line.

``configure(level, fmt)`` sets up the root logger once (uvicorn's loggers propagate to it; ``gateway.cli`` runs
uvicorn without a logging config of its own), so ``fmt="json"`` (``--log-format json``, ``MESHGATE_LOG_FORMAT``)
turns every line the process writes into JSON::

    text: 2026-01-02 03:04:05,678 INFO meshgate.requests: request id=req_... protocol=openai ... status=200 ...
    json: {"time": "2026-01-02T03:04:05.678Z", "level": "INFO", "logger": "meshgate.requests",
           "message": "request", "id": "req_...", "protocol": "openai", ..., "status": 200, ...}

A structured line is logged as a ``Fields`` message: its text is ``message`` then ``key=value`` pairs in logfmt
(``error``, and any value with a space, a quote, ``=`` or a control character, is quoted with JSON escapes;
``None`` is ``-``), and in
JSON its keys follow ``time``, ``level``, ``logger`` and ``message`` in the same order (``None`` is ``null``).
Runner processes write their own output; their lines are not rewritten.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Mapping

__all__ = ["Fields", "configure", "logfmt"]

_BARE = re.compile(r"[A-Za-z0-9_.:/@+\-]+")
_QUOTED = frozenset({"error"})  # always quoted, even when one word


class Fields:
    """A log message made of a word and named values, rendered as logfmt text or as JSON keys."""

    __slots__ = ("message", "values")

    def __init__(self, message: str, values: Mapping[str, str | int | float | None]) -> None:
        self.message = message
        self.values = values

    def __str__(self) -> str:
        return f"{self.message} {logfmt(self.values)}"


def logfmt(values: Mapping[str, str | int | float | None]) -> str:
    """``key=value`` pairs; strings that are not plain words are quoted (JSON escapes), ``None`` is ``-``."""
    parts = []
    for key, value in values.items():  # once per request line: kept to plain loops and builtins
        if value is None:
            parts.append(f"{key}=-")
        elif type(value) is str and (key in _QUOTED or not _BARE.fullmatch(value)):
            parts.append(f"{key}={json.dumps(value)}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, ms), ``level``, ``logger``, ``message``, then its fields."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, object] = {
            "time": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
        }
        if isinstance(record.msg, Fields):
            out["message"] = record.msg.message
            out.update(record.msg.values)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``%(asctime)s %(levelname)s %(name)s: %(message)s``, the date and time formatted once per second."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._second, self._stamp = -1, ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (logging's name)
        second = int(record.created)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%d %H:%M:%S", self.converter(second))
        return f"{self._stamp},{int(record.msecs):03d}"


def configure(level: str, fmt: str = "text") -> None:
    """The root logger at ``level``, writing to stderr in ``fmt`` (``text`` or ``json``)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # neither format shows threads or processes: do not look them up for every record (the logging HOWTO's
    # "Optimization"; a quarter of what making a ``LogRecord`` costs)
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
