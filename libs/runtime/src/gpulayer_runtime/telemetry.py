"""OpenTelemetry for every service: one trace per job across processes, and the metrics.

Export happens only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the per-signal variables) is set:
then spans and metrics go out over OTLP/HTTP with the standard OTEL_* settings. Without it,
nothing is set up and :data:`enabled` is false, so hot paths skip span and metric work
entirely (``if telemetry.enabled: ...``) — the no-op costs a branch, not a span object.

Trace context crosses NATS in message headers (W3C ``traceparent`` / ``tracestate``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_propagator = TraceContextTextMapPropagator()

# Every metric gpulayer emits: name -> (instrument kind, unit, description). Dashboards and docs
# are checked against this table.
METRICS: dict[str, tuple[str, str, str]] = {
    "gpulayer.placement.decision.duration": ("histogram", "s", "Time to match one job"),
    "gpulayer.placement.submit_to_grant.duration": (
        "histogram", "s", "From a job's publish to its grant's publish",
    ),
    "gpulayer.placement.placed": ("counter", "{job}", "Jobs placed"),
    "gpulayer.jobs": ("gauge", "{job}", "Jobs by state"),
    "gpulayer.jobs.pending": ("gauge", "{job}", "Waiting jobs by reason"),
    "gpulayer.nodes": ("gauge", "{node}", "Nodes by state, accelerator and platform"),
    "gpulayer.devices": ("gauge", "{device}", "Devices by state (allocated, free) and accelerator"),
    "gpulayer.node.info": (
        "gauge", "{node}", "One series (value 1) per node: hostname, platform, GPU APIs, state",
    ),
    "gpulayer.device.health": (
        "gauge", "1", "Per device: 0 healthy, 1 degraded, 2 unhealthy (the probe's verdict)",
    ),
    "gpulayer.device.temperature": ("gauge", "Cel", "Per device: GPU temperature"),
    "gpulayer.device.utilization": ("gauge", "%", "Per device: GPU utilization"),
    "gpulayer.device.memory.used": ("gauge", "MiBy", "Per device: GPU memory in use"),
    "gpulayer.device.power": ("gauge", "W", "Per device: power draw"),
    "gpulayer.device.ecc.uncorrected": (
        "gauge", "{error}", "Per device: uncorrected ECC errors since the driver loaded",
    ),
    "gpulayer.node.drift": (
        "counter", "{change}", "Changes between detections (vanished device, driver, memory)",
    ),
    "gpulayer.executor.job.duration": ("histogram", "s", "Job run time by outcome"),
    "gpulayer.executor.jobs": ("counter", "{job}", "Jobs ended by outcome"),
    "gpulayer.probe.detection.duration": ("histogram", "s", "Detection time per source"),
    "gpulayer.consumer.redeliveries": ("counter", "{message}", "Messages delivered more than once"),
    "gpulayer.messages.rejected": ("counter", "{message}", "Messages rejected as malformed or invalid"),
    "gpulayer.messages.dead_lettered": ("counter", "{message}", "Messages moved to the DLQ stream"),
    "gpulayer.consumer.max_deliveries": (
        "counter", "{message}", "Messages that reached a consumer's delivery limit",
    ),
    "gpulayer.executor.grants.refused": (
        "counter", "{message}", "Grants and cancels the executor refused (unsigned, forged, replayed...) by reason",
    ),
}  # fmt: skip


# The SDK's default buckets (0..10000) suit milliseconds; ours are seconds, from a placement
# decision (sub-millisecond) to a long job.
SECONDS_BUCKETS = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0,
]  # fmt: skip


def prometheus_name(name: str) -> str:
    """The name a metric gets behind the Collector's Prometheus exporter."""
    kind, unit, _ = METRICS[name]
    base = name.replace(".", "_")
    if unit == "s":
        base += "_seconds"
    if kind == "counter":
        base += "_total"
    return base


class Telemetry:
    """Tracer and instruments of one service. Created once in the service's ``__main__``."""

    def __init__(self, service: str, *, enabled: bool) -> None:
        self.service = service
        self.enabled = enabled
        self.tracer: Tracer = trace.get_tracer(service)
        meter = metrics.get_meter(service)
        self._meter = meter
        self.histograms = {
            name: meter.create_histogram(
                name,
                unit=unit,
                description=desc,
                explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
            )
            for name, (kind, unit, desc) in METRICS.items()
            if kind == "histogram"
        }
        self.counters = {
            name: meter.create_counter(name, unit=unit, description=desc)
            for name, (kind, unit, desc) in METRICS.items()
            if kind == "counter"
        }
        self._shutdown: list[Callable[[], Any]] = []

    def record(self, name: str, value: float, attributes: Mapping[str, Any] | None = None) -> None:
        if self.enabled:
            self.histograms[name].record(value, attributes)

    def count(self, name: str, value: int = 1, attributes: Mapping[str, Any] | None = None) -> None:
        if self.enabled:
            self.counters[name].add(value, attributes)

    def gauge(
        self, name: str, callback: Callable[[], Sequence[tuple[float, Mapping[str, Any]]]]
    ) -> None:
        """An observable gauge read at each export; ``callback`` returns (value, attributes)."""
        if not self.enabled:
            return
        _, unit, desc = METRICS[name]

        def observe(_options: metrics.CallbackOptions) -> Iterator[metrics.Observation]:
            for value, attrs in callback():
                yield metrics.Observation(value, attrs)

        self._meter.create_observable_gauge(name, callbacks=[observe], unit=unit, description=desc)

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        *,
        parent: otel_context.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
    ) -> Iterator[Span | None]:
        """A span when telemetry is on; ``None`` (and no work) when it is off."""
        if not self.enabled:
            yield None
            return
        with self.tracer.start_as_current_span(
            name, context=parent, kind=kind, attributes=attributes
        ) as s:
            yield s

    def shutdown(self) -> None:
        for fn in self._shutdown:
            with contextlib.suppress(Exception):
                fn()


def inject(headers: dict[str, str], span: Span | None = None) -> dict[str, str]:
    """Add W3C trace context (of ``span`` or the current span) to NATS headers."""
    ctx = trace.set_span_in_context(span) if span is not None else None
    _propagator.inject(headers, context=ctx)
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """The trace context a message carried, or None."""
    if not headers or "traceparent" not in headers:
        return None
    return _propagator.extract(headers)


def _exporting(env: Mapping[str, str]) -> bool:
    return (
        any(
            env.get(k)
            for k in (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            )
        )
        and env.get("OTEL_SDK_DISABLED", "").lower() != "true"
    )


def setup_telemetry(
    service: str,
    env: Mapping[str, str],
    *,
    metrics_export: bool = True,
    export_timeout_s: float | None = None,
) -> Telemetry:
    """Install OTLP exporters when an endpoint is configured; otherwise a disabled Telemetry.

    A short-lived command (the CLI) passes ``metrics_export=False`` (it has no metrics) and an
    ``export_timeout_s``: its spans are sent as it exits, and an unreachable collector must not
    hold the exit up for the exporter's default 10 s. ``OTEL_EXPORTER_OTLP_TIMEOUT`` (or the
    traces one), when set, still wins."""
    if not _exporting(env):
        return Telemetry(service, enabled=False)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Several replicas of one service must not collide in the metrics backend.
    instance = f"{socket.gethostname()}-{os.getpid()}"
    resource = Resource.create(
        {SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service, SERVICE_INSTANCE_ID: instance}
    )
    tracer_provider = TracerProvider(resource=resource)
    timeout_set = env.get("OTEL_EXPORTER_OTLP_TIMEOUT") or env.get(
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
    )
    span_exporter = (
        OTLPSpanExporter(timeout=export_timeout_s)
        if export_timeout_s is not None and not timeout_set
        else OTLPSpanExporter()
    )
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(tracer_provider)
    shutdown: list[Callable[[], Any]] = [tracer_provider.shutdown]
    if metrics_export:
        meter_provider = MeterProvider(
            resource=resource,
            metric_readers=[PeriodicExportingMetricReader(OTLPMetricExporter())],
        )
        metrics.set_meter_provider(meter_provider)
        shutdown.append(meter_provider.shutdown)
    tel = Telemetry(service, enabled=True)
    tel._shutdown += shutdown
    log.info("telemetry: exporting OTLP as %s", service)
    return tel


DISABLED = Telemetry("gpulayer", enabled=False)
