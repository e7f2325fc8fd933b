"""A real OTLP/HTTP endpoint for tests: decodes the protobuf payloads the services export."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class SpanRecord:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class MetricPoint:
    service: str
    name: str
    kind: str
    attributes: dict[str, Any]
    value: float  # gauge/sum value, or histogram count
    total: float = 0.0  # histogram sum
    time_unix_nano: int = 0  # when it was measured (one collection shares one time)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class Received:
    spans: list[SpanRecord] = field(default_factory=list)
    metrics: list[MetricPoint] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def wait(self, predicate: Callable[[Received], bool], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self), timeout)


class OtlpReceiver:
    def __init__(self) -> None:
        self.received = Received()
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    _traces(received, body)
                    reply = ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    _metrics(received, body)
                    reply = ExportMetricsServiceResponse().SerializeToString()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _traces(received: Received, body: bytes) -> None:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        service = _attrs(rs.resource.attributes).get("service.name", "")
        for ss in rs.scope_spans:
            for sp in ss.spans:
                out.append(
                    SpanRecord(
                        service=service,
                        name=sp.name,
                        trace_id=sp.trace_id.hex(),
                        span_id=sp.span_id.hex(),
                        parent_span_id=sp.parent_span_id.hex(),
                        attributes=_attrs(sp.attributes),
                    )
                )
    with received.cond:
        received.spans.extend(out)
        received.cond.notify_all()


def _metrics(received: Received, body: bytes) -> None:
    req = ExportMetricsServiceRequest()
    req.ParseFromString(body)
    out = []
    for rm in req.resource_metrics:
        service = _attrs(rm.resource.attributes).get("service.name", "")
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                if kind == "histogram":
                    for hp in m.histogram.data_points:
                        out.append(
                            MetricPoint(
                                service, m.name, kind, _attrs(hp.attributes), hp.count, hp.sum
                            )
                        )
                elif kind in ("gauge", "sum"):
                    for np in getattr(m, kind).data_points:
                        v = np.as_double if np.WhichOneof("value") == "as_double" else np.as_int
                        attrs = _attrs(np.attributes)
                        out.append(
                            MetricPoint(service, m.name, kind, attrs, v, 0.0, np.time_unix_nano)
                        )
    with received.cond:
        received.metrics.extend(out)
        received.cond.notify_all()
