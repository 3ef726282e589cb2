"""Prometheus metrics (prometheus-client): requests by route and status, latency, batches, queue
depth and GPU residency, served at GET /metrics in the text exposition format."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
POWERS_OF_TWO = tuple(float(1 << i) for i in range(14))


_PID = [os.getpid()]  # this process's id, kept: prometheus-client asks for it at every value it writes
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


def _use_kept_pid() -> None:
    """prometheus-client's multiprocess values, told this process's id from `_PID` instead of os.getpid(): a system
    call for every value written, 7 a request in a front (strace)."""
    from prometheus_client import values

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and not getattr(values.ValueClass, "kept_pid", False):
        values.ValueClass = values.MultiProcessValue(lambda: _PID[0])
        values.ValueClass.kept_pid = True  # type: ignore[attr-defined]


class Metrics:
    """The HTTP side's metrics and (`engine`) the engine's.  In a front process of `qgemm serve`
    (PROMETHEUS_MULTIPROC_DIR set) the HTTP counters are prometheus-client's multiprocess values, summed over every
    front at each scrape, and the engine's come from the engine process (`render`'s `extra`)."""

    def __init__(self, engine: bool = True) -> None:
        _use_kept_pid()
        self.registry = CollectorRegistry()  # one per app, so that test apps do not share counts
        r = self.registry
        self.requests = Counter("qgemm_http_requests", "HTTP requests by route template, method and status",
                                ["route", "method", "status"], registry=r)
        self.latency = Histogram("qgemm_http_request_seconds", "Time from the request's start to its last byte",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        if engine:
            self._engine_metrics(r)

    def _engine_metrics(self, r: CollectorRegistry) -> None:
        self.batch_requests = Histogram("qgemm_batch_requests", "Requests (or chunks) per product run on the device",
                                        buckets=POWERS_OF_TWO, registry=r)
        self.batch_rows = Histogram("qgemm_batch_rows", "Rows (M) per product run on the device",
                                    buckets=POWERS_OF_TWO, registry=r)
        self.queue_depth = Gauge("qgemm_queue_depth", "Requests (or chunks) waiting for the device", registry=r)
        self.resident_bytes = Gauge("qgemm_gpu_resident_bytes", "Weight bytes resident on the GPU", registry=r)
        self.gpu_budget_bytes = Gauge("qgemm_gpu_budget_bytes", "The GPU weight budget", registry=r)
        self.pinned_output_bytes = Gauge("qgemm_pinned_output_bytes", "Page-locked host memory held for large "
                                         "outputs (in answers and free for reuse; at most QGEMM_PINNED_OUTPUT_BYTES)",
                                         registry=r)

    def render(self, extra: str = "") -> bytes:
        """The exposition text: this process's registry, or every front's (multiprocess), merged with `extra` (the
        engines'): each family once, as strict parsers require."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        else:
            registry = self.registry
        own = generate_latest(registry)
        if not extra:
            return own
        return merge_exposition([own.decode(), extra]).encode()  # a family the engines also declare appears once

    def observe_batch(self, requests: int, rows: int) -> None:
        self.batch_requests.observe(requests)
        self.batch_rows.observe(rows)

    def track(self, workers: Sequence[Any], gpus: Sequence[Any], pinned: Any = None) -> None:
        """Gauges read when scraped: the totals, and each device's (a collector with a `device` label);
        `pinned`: the engine's pool of pinned output buffers (None without a GPU)."""
        self.queue_depth.set_function(lambda: sum(w.scheduler.depth() for w in workers))
        if gpus:
            self.resident_bytes.set_function(lambda: sum(w.memory()[0] for w in gpus))
            self.gpu_budget_bytes.set_function(lambda: sum(w.memory()[1] for w in gpus))
        if pinned is not None:
            self.pinned_output_bytes.set_function(lambda: pinned.held)
        self.registry.register(DeviceCollector(workers))


class DeviceCollector(Collector):
    """Each device worker's queue, weights and products, labelled by device (cuda:0, cpu:0...)."""

    def __init__(self, workers: Sequence[Any]):
        self.workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        depth = GaugeMetricFamily("qgemm_device_queue_depth", "Requests (or chunks) waiting for this device",
                                  labels=["device"])
        held = GaugeMetricFamily("qgemm_device_resident_bytes", "Weight bytes this device holds (GPU: resident; "
                                 "CPU: prepared)", labels=["device"])
        budget = GaugeMetricFamily("qgemm_device_budget_bytes", "This device's weight budget", labels=["device"])
        products = CounterMetricFamily("qgemm_device_products", "Products (batches) this device ran",
                                       labels=["device"])
        for w in self.workers:
            used, total = w.memory()
            depth.add_metric([w.label], w.scheduler.depth())
            held.add_metric([w.label], used)
            budget.add_metric([w.label], total)
            products.add_metric([w.label], w.products)
        yield from (depth, held, budget, products)


PATHS_KEPT = 4096


class RequestMetrics:
    """ASGI middleware: counts each HTTP request by its route template (not its raw path, so that
    model and tensor names do not make unbounded label sets) and status, and times it."""

    def __init__(self, app: ASGIApp, metrics: Metrics, templates: Callable[[], list[str]]):
        self.app, self.metrics, self.templates = app, metrics, templates
        self._patterns: list[tuple[re.Pattern[str], str]] | None = None
        # the paths seen and the labelled children used, kept: a request looks them up instead of matching the
        # templates and asking prometheus-client for its children again (both bounded: cleared when full)
        self._of_path: dict[str, str] = {}
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def template(self, path: str) -> str:
        """The route template a path matched (from the OpenAPI paths: routers nested under a prefix
        know only their own part of it; `{name:path}` takes slashes), or "(unmatched)"."""
        if self._patterns is None:
            self._patterns = [(re.compile("^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.sub(
                r"\\{[^/]+?:path\\}", ".+", re.escape(t))) + "$"), t) for t in self.templates()]
        return next((t for pattern, t in self._patterns if pattern.match(path)), "(unmatched)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            if scope.get("state", {}).get("client_gone"):
                status = 499  # the client closed the connection before its answer (nginx's code): not a server fault
            path = scope["path"]
            template = self._of_path.get(path)
            if template is None:
                if len(self._of_path) >= PATHS_KEPT:
                    self._of_path.clear()
                template = self._of_path[path] = self.template(path)
            key = (template, scope["method"], status)
            children = self._children.get(key)
            if children is None:
                if len(self._children) >= PATHS_KEPT:
                    self._children.clear()
                children = self._children[key] = (self.metrics.requests.labels(template, key[1], str(status)),
                                                  self.metrics.latency.labels(template))
            children[0].inc()
            children[1].observe(time.perf_counter() - t0)


def merge_exposition(texts: list[str]) -> str:
    """Several engines' exposition texts as one, each family once: samples with the same name and labels summed (the
    totals, the batch histograms), the rest side by side (each device's own, labelled by device)."""
    if len(texts) <= 1:
        return texts[0] if texts else ""
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: dict[str, Any] = {}
    values: dict[str, dict[tuple, Sample]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, family)
            merged = values.setdefault(family.name, {})
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                old = merged.get(key)
                if old is None:
                    merged[key] = s
                elif s.name.endswith("_created"):  # the earliest start
                    merged[key] = s._replace(value=min(old.value, s.value))
                else:
                    merged[key] = s._replace(value=old.value + s.value)
    for name, family in families.items():
        family.samples = list(values[name].values())

    class Merged(Collector):
        def collect(self) -> Iterator[Any]:
            yield from families.values()

    registry = CollectorRegistry()
    registry.register(Merged())
    return generate_latest(registry).decode()
