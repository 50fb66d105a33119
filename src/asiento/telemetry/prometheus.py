"""``serve_metrics``: the process's asiento metrics on an HTTP port, for a Prometheus scrape.

An OpenTelemetry SDK ``MeterProvider`` with a ``PrometheusMetricReader`` is set as
the global one, so the instruments of ``asiento.telemetry.metrics`` report to it,
and ``prometheus_client`` serves them at ``http://HOST:PORT/metrics``. It needs
the ``metrics`` extra: ``pip install 'asiento[metrics]'``.
"""

from __future__ import annotations

from ..errors import UsageError

EXTRA = "pip install 'asiento[metrics]'"


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Serve the metrics on ``host:port`` from a daemon thread; ``UsageError`` when the
    extra is missing, the port cannot be bound, or the process set its own provider."""
    try:
        from opentelemetry import metrics
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider
        from prometheus_client import start_http_server
    except ImportError as exc:
        raise UsageError(f"metrics need {exc.name or 'a package'} installed: {EXTRA}") from None
    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise UsageError(f"cannot serve metrics on {host} port {port}: {why}") from None
    provider = MeterProvider(metric_readers=[PrometheusMetricReader()])
    metrics.set_meter_provider(provider)
    if metrics.get_meter_provider() is not provider:
        raise UsageError(
            "this process already set an OpenTelemetry MeterProvider: add a"
            " PrometheusMetricReader to it yourself instead of giving --metrics-port"
        )
