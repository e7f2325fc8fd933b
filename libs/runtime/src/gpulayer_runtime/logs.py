"""Logging setup for every process: text by default, JSON lines with GPULAYER_LOG_FORMAT=json.

A JSON line carries ``trace_id`` / ``span_id`` (W3C hex) when it is about a job that has a trace,
and ``job_id`` / ``node_id`` when it is about a job or node. Pass them with
``log.info(..., extra=job_context(...))``; a line logged inside an active OpenTelemetry span gets
that span's ids.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

_FIELDS = ("trace_id", "span_id", "job_id", "node_id")


def job_context(
    job_id: str | None = None, node_id: str | None = None, traceparent: str | None = None
) -> dict[str, str]:
    """``extra`` for a log call about a job: its ids, and the trace it belongs to (from the W3C
    ``traceparent`` it travelled with: ``00-<trace id>-<span id>-<flags>``)."""
    out: dict[str, str] = {}
    if job_id:
        out["job_id"] = job_id
    if node_id:
        out["node_id"] = node_id
    parts = (traceparent or "").split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and len(parts[2]) == 16:
        out["trace_id"], out["span_id"] = parts[1], parts[2]
    return out


def _current_span_ids() -> tuple[str, str] | None:
    if "opentelemetry.trace" not in sys.modules:  # telemetry never set up: no span can be open
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in _FIELDS:
            if hasattr(record, key):
                out[key] = getattr(record, key)
        if "trace_id" not in out and (ids := _current_span_ids()) is not None:
            out["trace_id"], out["span_id"] = ids
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(service: str, fmt: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
