"""Prometheus metrics of the worker (``gnnstream_`` prefix, base units) and the HTTP endpoint.

``/metrics`` serves the Prometheus text format, ``/healthz`` a JSON status:
200 while the worker is consuming and has polled recently, 503 otherwise,
with a ``reason`` saying what it waits for (Kafka, a backfill, the group
join ...). The server binds 127.0.0.1 unless told otherwise, and closes a
connection that sends no complete request within ``request_timeout_s``, so
idle clients do not each hold a thread for ever.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

__all__ = ["WorkerMetrics", "MetricsServer", "BatchHistogram"]

logger = logging.getLogger(__name__)

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_FRESHNESS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600, 86400, 86400 * 365 * 30)
_COUNTS = (1, 10, 100, 1_000, 10_000, 100_000, 1_000_000)


class BatchHistogram:
    """A Prometheus histogram that takes a whole array of observations in one call.

    ``prometheus_client.Histogram`` observes one value per call; a batch of
    50,000 published embeddings would cost 50,000 calls. Here the bucket
    counts of a batch come from one ``numpy.searchsorted`` and one
    ``bincount`` and are added under a lock; the exposition is the same as
    ``Histogram``'s (``_bucket{le=...}`` cumulative, ``_count``, ``_sum``),
    with a value exactly on a bound counted in that bound's bucket (``le``).

    Args:
        name: metric name (without ``_bucket`` etc.).
        documentation: help text.
        buckets: increasing upper bounds; ``+Inf`` is added.
        registry: where to register it.
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self._bounds = np.asarray(buckets, dtype=np.float64)
        self._counts = np.zeros(len(buckets) + 1, dtype=np.int64)  # per bucket, the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.observe_many(np.asarray([value], dtype=np.float64))

    def observe_many(self, values: np.ndarray) -> None:
        """Add every value of ``values`` (a 1-D array) as one observation."""
        values = np.asarray(values, dtype=np.float64).ravel()
        if not len(values):
            return
        counts = np.bincount(np.searchsorted(self._bounds, values, side="left"), minlength=len(self._counts))
        total = float(values.sum())
        with self._lock:
            self._counts += counts
            self._sum += total

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> list[HistogramMetricFamily]:
        with self._lock:
            cumulative = np.cumsum(self._counts).tolist()
            total = self._sum
        bounds = [floatToGoString(b) for b in self._bounds.tolist()] + ["+Inf"]
        family = HistogramMetricFamily(self.name, self.documentation)
        family.add_metric([], list(zip(bounds, cumulative)), sum_value=total)
        return [family]


class WorkerMetrics:
    """All metrics of one worker, in their own registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.events = Counter("gnnstream_events", "Valid events applied, by op", ["op"], registry=r)
        self.invalid = Counter("gnnstream_invalid_events", "Invalid events sent to the dead-letter topic, by reason",
                               ["reason"], registry=r)
        self.apply_seconds = Histogram("gnnstream_apply_seconds", "Time to apply one batch to the store",
                                       buckets=_LATENCY, registry=r)
        self.recompute_seconds = Histogram("gnnstream_recompute_seconds", "Time to recompute one batch",
                                           buckets=_LATENCY, registry=r)
        self.publish_seconds = Histogram("gnnstream_publish_seconds", "Time to publish and flush one batch",
                                         buckets=_LATENCY, registry=r)
        self.published = Counter("gnnstream_embeddings_published", "Embedding updates published", registry=r)
        self.suppressed = Counter("gnnstream_updates_suppressed",
                                  "Embedding updates not published because they moved by no more than "
                                  "--min-change (relative L2) since the node's last published version", registry=r)
        self.dirty = Gauge("gnnstream_dirty_nodes", "Nodes recomputed per layer in the last batch", ["layer"],
                           registry=r)
        self.lag = Gauge("gnnstream_consumer_lag", "Events behind the high watermark", ["partition"], registry=r)
        # one observation per published embedding, added a batch at a time
        self.freshness = BatchHistogram("gnnstream_embedding_freshness_seconds",
                                        "Publish time minus event time of published embeddings",
                                        _FRESHNESS, registry=r)
        self.batch_size = Histogram("gnnstream_batch_events", "Records polled per micro-batch",
                                    buckets=_COUNTS, registry=r)
        self.batch_target = Gauge("gnnstream_batch_target", "Records the last poll asked for: the dynamic batch "
                                  "target (--batch-size .. --max-batch-size, capped by --max-latency-ms)", registry=r)
        self.pipeline = Histogram("gnnstream_pipeline_latency_seconds",
                                  "Publish time minus Kafka record time of the oldest event in the batch",
                                  buckets=_FRESHNESS, registry=r)
        self.sampled = Histogram("gnnstream_sampled_neighbours", "Sampled neighbours read per batch",
                                 buckets=_COUNTS, registry=r)
        self.subgraph_edges = Histogram("gnnstream_subgraph_edges", "Edges of the recomputed subgraph per batch",
                                        buckets=_COUNTS, registry=r)
        self.fanout_capped = Counter("gnnstream_fanout_capped", "Recomputed nodes whose neighbourhood exceeded the fanout",
                                     registry=r)
        self.owned = Gauge("gnnstream_owned_partitions", "Output partitions this worker computes and publishes",
                           registry=r)
        self.deferred = Gauge("gnnstream_deferred_hubs", "Hub propagations currently deferred", registry=r)
        self.deferred_total = Counter("gnnstream_deferred_hub_propagations",
                                      "Hub propagations deferred and coalesced", registry=r)
        self.staleness = Gauge("gnnstream_deferred_staleness_seconds", "Age of the oldest deferred propagation",
                               registry=r)
        self.batches = Counter("gnnstream_batches", "Micro-batches processed", registry=r)
        self.stream_time = Gauge("gnnstream_stream_time_seconds", "Stream time T: the largest event ts applied "
                                 "(seconds since the epoch)", registry=r)
        self.edges_expired = Counter("gnnstream_edges_expired", "Edges removed because they fell out of the edge "
                                     "window (--edge-ttl)", registry=r)
        self.late_events = Counter("gnnstream_late_events", "Edge upserts that arrived at or before T - edge ttl "
                                   "(endpoints created, the edge not)", registry=r)
        self.stage_changes = Counter("gnnstream_stage_changes", "Nodes whose stage of the staged cold-start "
                                     "policy changed with stream time, by the stage entered", ["stage"], registry=r)
        self.errors = Counter("gnnstream_errors", "Errors by kind: transient ones, retried (poll, publish, "
                              "dead_letter, consumer, kafka_setup), offset_reset (a stored offset past the end of "
                              "its partition) and dead_letter_<error kind> (a dead letter the topic refused even "
                              "cut to fit, skipped); see docs/operations.md", ["kind"], registry=r)
        self.transaction_scores = Counter("gnnstream_transaction_scores", "Transaction scores published (a typed "
                                          "model with a transaction head)", registry=r)
        self.transactions_unscored = Counter("gnnstream_transactions_unscored", "Applied transactions not scored: an "
                                             "end was deleted in the batch that applied them", registry=r)
        self.truncated = Counter("gnnstream_dead_letters_truncated", "Dead letters written cut to fit the record "
                                 "size limit (headers gnnstream.truncated, gnnstream.original.*)", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """``/metrics`` and ``/healthz`` on a background thread.

    Args:
        metrics: what ``/metrics`` renders.
        port: TCP port (0 = a free one, see :attr:`port`).
        health: returns the ``/healthz`` JSON; its ``ok`` picks 200 or 503.
        host: address to bind; 127.0.0.1 keeps the endpoint on this machine,
            0.0.0.0 opens it on every interface (containers).
        request_timeout_s: a connection idle this long without a complete
            request is closed (one thread per open connection).
    """

    def __init__(self, metrics: WorkerMetrics, port: int, health: Callable[[], dict[str, Any]],
                 host: str = "127.0.0.1", request_timeout_s: float = 5.0):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout_s  # socket timeout of each connection (StreamRequestHandler)

            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                if self.path.startswith("/metrics"):
                    body, status, ctype = metrics.render(), 200, CONTENT_TYPE_LATEST
                elif self.path.startswith("/healthz"):
                    try:
                        info = health()
                    except Exception as exc:  # never a dropped connection: say what failed
                        logger.warning("health check failed: %r", exc)
                        info = {"ok": False, "reason": f"health check failed: {exc!r}"}
                    body = json.dumps(info).encode()
                    status, ctype = (200 if info.get("ok") else 503), "application/json"
                else:
                    body, status, ctype = b"not found\n", 404, "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise OSError(f"cannot serve /metrics and /healthz on {host}:{port} ({exc.strerror}); "
                          "choose another --metrics-port (0 = off) or --metrics-host") from exc
        self.host = host
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)
        self.thread.start()
        owner.started = time.time()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
