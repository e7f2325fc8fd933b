"""JSON log lines: a job's ids and its trace, from `extra` or the active span."""

from __future__ import annotations

import json
import logging

from opentelemetry.sdk.trace import TracerProvider

from gpulayer_runtime.logs import JsonFormatter, job_context

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


def _line(msg: str, **extra: str) -> dict[str, str]:
    record = logging.LogRecord(
        "gpulayer_executor.service", logging.INFO, __file__, 1, msg, (), None
    )
    record.__dict__.update(extra)
    out: dict[str, str] = json.loads(JsonFormatter().format(record))
    return out


def test_a_job_line_names_the_job_the_node_and_the_trace_it_travelled_with() -> None:
    line = _line("job j1 succeeded", **job_context("j1", "node-a", f"00-{TRACE}-{SPAN}-01"))
    assert line["msg"] == "job j1 succeeded"
    assert line["level"] == "info"
    assert (line["job_id"], line["node_id"], line["trace_id"], line["span_id"]) == (
        "j1",
        "node-a",
        TRACE,
        SPAN,
    )


def test_a_malformed_traceparent_adds_no_trace_ids() -> None:
    assert job_context("j1", traceparent="00-short-ids-01") == {"job_id": "j1"}
    assert job_context(node_id="n") == {"node_id": "n"}
    assert "trace_id" not in _line("plain")


def test_a_line_logged_inside_a_span_gets_its_ids() -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("work") as span:
        ctx = span.get_span_context()
        line = _line("inside")
    assert line["trace_id"] == f"{ctx.trace_id:032x}"
    assert line["span_id"] == f"{ctx.span_id:016x}"
