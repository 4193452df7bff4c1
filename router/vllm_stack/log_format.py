"""The router's log lines: production-stack's ``--log-format`` (``text``, the default, or ``json``).

JSON is for log pipelines (Loki, Elasticsearch, Cloud Logging) that index fields instead of parsing
text: one object per line with production-stack's field names (``timestamp``, ``level``, ``logger``,
``message``, ``filename``, ``lineno``, ``exception``) plus ``request_id`` and ``trace_id`` where the
line is about one request (the access log passes them as the record's ``extra``), so a line can be
joined with the client's ``X-Request-Id`` and with the request's trace. Only these fields are written,
never the record's other attributes, so nothing a caller attaches to a record (a header, a key)
reaches the output by accident. The standard library and orjson are all it takes (a formatter of a
dozen lines), so no logging library is added to the router's dependencies.
"""

from __future__ import annotations

import logging
import time

import orjson

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: the record attributes copied into a JSON line when present (the access log's ``extra``)
REQUEST_FIELDS = ("request_id", "trace_id")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "filename": record.filename,
            "lineno": record.lineno,
        }
        for name in REQUEST_FIELDS:
            value = record.__dict__.get(name)
            if value:
                line[name] = value
        if record.exc_info and record.exc_info[0] is not None:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return orjson.dumps(line, default=str).decode()


def formatter(log_format: str) -> logging.Formatter:
    """The formatter of ``log_format`` (one of :data:`LOG_FORMATS`)."""
    return JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)


def configure(level: str, log_format: str) -> None:
    """The process's root handler (stderr) at ``level`` in ``log_format``: what every module's logger
    writes through. Process-wide, so called once by the command line, never by the router object."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(log_format))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
