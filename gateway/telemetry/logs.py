"""Log output for ``meshgate serve`` and ``meshgate node``: text lines, or one JSON object per line.

``configure(level, fmt)`` sets up the root logger once (uvicorn's loggers propagate to it; ``gateway.cli.commands`` runs
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

__all__ = ["Fields", "JsonFormatter", "LineHandler", "TextFormatter", "configure", "logfmt", "plain_handler"]

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
        out = self._head(record.created, record.levelname, record.name)
        if isinstance(record.msg, Fields):
            out["message"] = record.msg.message
            out.update(record.msg.values)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)

    def line(self, created: float, level: str, logger: str, fields: Fields) -> str:
        """What ``format`` makes of a record with these values and ``fields`` as its message."""
        out = self._head(created, level, logger)
        out["message"] = fields.message
        out.update(fields.values)
        return json.dumps(out, default=str)

    @staticmethod
    def _head(created: float, level: str, logger: str) -> dict[str, object]:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
        return {"time": f"{stamp}.{int(created * 1000) % 1000:03d}Z", "level": level, "logger": logger}


class TextFormatter(logging.Formatter):
    """``%(asctime)s %(levelname)s %(name)s: %(message)s``, the date and time formatted once per second."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._second, self._stamp = -1, ""

    def line(self, created: float, level: str, logger: str, fields: Fields) -> str:
        """What ``format`` makes of a record with these values and ``fields`` as its message."""
        return f"{self._time(created)} {level} {logger}: {fields}"

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (logging's name)
        return self._time(record.created)

    def _time(self, created: float) -> str:
        second = int(created)
        if second != self._second:
            self._second, self._stamp = second, time.strftime("%Y-%m-%d %H:%M:%S", self.converter(second))
        return f"{self._stamp},{int(created * 1000) % 1000:03d}"


class LineHandler(logging.StreamHandler):
    """The ``StreamHandler`` ``configure`` installs; it also takes lines made already (``write_lines``)."""

    def line(self, created: float, level: str, logger: str, fields: Fields) -> str:
        """The line this handler writes for a record of these values with ``fields`` as its message (its
        formatter is ``configure``'s: ``plain_handler`` checks)."""
        formatter: TextFormatter | JsonFormatter = self.formatter  # type: ignore[assignment]
        return formatter.line(created, level, logger, fields)

    def write_lines(self, lines: list[str]) -> None:
        """``lines`` (formatted by this handler's formatter's ``line``) in one write."""
        if not lines:
            return
        try:
            with self.lock:  # type: ignore[union-attr]  # made by Handler.__init__
                self.stream.write("\n".join(lines) + "\n")
                self.flush()
        except Exception:  # as ``StreamHandler.emit``: a broken stream is reported, never raised to the caller
            self.handleError(logging.makeLogRecord({"name": "meshgate.requests", "msg": f"{len(lines)} lines"}))


def plain_handler(logger: logging.Logger, level: int) -> LineHandler | None:
    """The one handler ``logger``'s records at ``level`` reach when the process's logging is ``configure``'s and
    nothing on the way filters or copies them, else ``None``. Then a batch of lines can go to it at once, made by
    its formatter's ``line`` (the request log: a ``LogRecord`` and the handler chain per line cost more than
    making the line)."""
    root = logging.getLogger()
    if len(root.handlers) != 1 or type(root.handlers[0]) is not LineHandler or not logger.isEnabledFor(level):
        return None
    handler = root.handlers[0]
    node: logging.Logger | None = logger
    while node is not None and node is not root:
        if node.filters or node.handlers or not node.propagate or node.disabled:
            return None
        node = node.parent
    if root.filters or handler.filters or level < handler.level:
        return None
    return handler if isinstance(handler.formatter, TextFormatter | JsonFormatter) else None


def configure(level: str, fmt: str = "text") -> None:
    """The root logger at ``level``, writing to stderr in ``fmt`` (``text`` or ``json``)."""
    handler = LineHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # neither format shows threads or processes: do not look them up for every record (the logging HOWTO's
    # "Optimization"; a quarter of what making a ``LogRecord`` costs)
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
