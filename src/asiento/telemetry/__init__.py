"""What a worker reports about itself: metrics on the OpenTelemetry metrics API.

``metrics`` holds the instruments and the one call each fact is recorded with;
``prometheus.serve_metrics`` exposes them for a Prometheus scrape (``asiento
worker --metrics-port``). Without ``opentelemetry-api`` every record is a no-op.
"""

from __future__ import annotations
