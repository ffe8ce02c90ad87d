"""Prometheus metrics (prometheus_client): what the code observes as it runs, and how /metrics is served.

Observed where things happen (one line each in the code that does them):
- `SSH_PROBE_SECONDS`: one health probe of a node over SSH, by outcome (ok, failed, busy);
- `BOOKING_SECONDS`: one booking (`instance_create`), failures included;
- `WEBHOOK_FAILURES`: Stripe webhook events whose processing failed, by event type;
- `record_meter_tick()`: when the last metering tick finished (kept in the shared cache, read at scrape time).

Computed at scrape time by collectors the app above the domain apps registers (operations/metrics.py: a few
aggregate queries, never one per row) and by `QueueDepthCollector` here (Redis LLEN per queue).

Processes. Without PROMETHEUS_MULTIPROC_DIR the histograms and counters live in each process's memory and
/metrics shows the answering process's own (right for the demo, tests and a single-process server). With it set
(production; docker-compose sets it on every web and worker container of a host, sharing one volume),
prometheus_client writes each process's values to files there and /metrics adds up every process of the host:
all gunicorn workers, and the Celery workers that observe SSH probes. Set it to an empty directory that
every process of the host can write, before any process starts (scripts/release empties it).

Access (`metrics_allowed`): a staff user's session, or `Authorization: Bearer <METRICS_TOKEN>` when the setting is
set. Anyone else gets a 404 (the endpoint is not advertised); a wrong bearer token gets a 401.
"""
from __future__ import annotations

import functools
import hmac
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from typing import ParamSpec, TypeVar

from django.conf import settings
from django.core.cache import cache
from django.http import Http404, HttpRequest, HttpResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import REGISTRY, Collector

log = logging.getLogger(__name__)

if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    # One file per process, named by host and pid: containers sharing the directory (docker-compose's `metrics`
    # volume) each count pids from 1, so the pid alone would let two processes write one file.
    from prometheus_client import values as _values

    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)

    _values.ValueClass = _values.MultiProcessValue(  # type: ignore[no-untyped-call]
        process_identifier=lambda: f"{socket.gethostname()}-{os.getpid()}")

SSH_PROBE_SECONDS = Histogram(
    "gpumarket_ssh_probe_seconds", "Time of one SSH health probe of a node (connect, agent `health`, answer).",
    ["outcome"], buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30),
)
BOOKING_SECONDS = Histogram(
    "gpumarket_booking_seconds", "Time of one booking (instance_create: funds, GPU allocation, instance), "
    "refusals included.", buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
WEBHOOK_FAILURES = Counter(
    "gpumarket_webhook_failures", "Stripe webhook events whose processing failed (each failed attempt).", ["type"],
)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def observes_ssh_probe(probe: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate a probe function whose result has `seconds`, `ok` and `busy`: each call is observed in
    SSH_PROBE_SECONDS under its outcome (ok, busy: every SSH slot of the node taken, failed)."""

    @functools.wraps(probe)
    def observed(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        result = probe(*args, **kwargs)
        ssh_probe_observe(result)
        return result

    return observed


def ssh_probe_observe(result: object) -> None:
    """Observe one probe's result (with `seconds`, `ok` and `busy`) in SSH_PROBE_SECONDS."""
    outcome = "ok" if getattr(result, "ok", False) else "busy" if getattr(result, "busy", False) else "failed"
    SSH_PROBE_SECONDS.labels(outcome=outcome).observe(float(getattr(result, "seconds", 0.0) or 0.0))


METER_TICK_CACHE_KEY = "metrics:meter:last_tick_at"


def record_meter_tick(at: float | None = None) -> None:
    """Note that a metering tick finished (the scrape reports how long ago: a stuck meter shows)."""
    try:
        cache.set(METER_TICK_CACHE_KEY, at if at is not None else time.time(), timeout=None)
    except Exception as exc:  # noqa: BLE001 (a cache outage must not fail the tick that just billed)
        log.warning("metrics: could not record the meter tick: %s", exc)


def last_meter_tick() -> float | None:
    value = cache.get(METER_TICK_CACHE_KEY)
    return float(value) if value is not None else None


# ------------------------------------------------------------------------------ scrape-time collectors


class QueueDepthCollector(Collector):
    """Messages waiting in each Celery queue: Redis LLEN of the queue's lists (kombu keeps one list per priority
    step; all are counted). Nothing is reported for another broker (the first-run filesystem one)."""

    def __init__(self, queues: Callable[[], Iterable[str]]):
        self.queues = queues

    def collect(self) -> Iterator[Metric]:
        url = settings.CELERY_BROKER_URL
        if not url.startswith(("redis://", "rediss://")):
            return
        import redis
        from kombu.transport.redis import PRIORITY_STEPS

        options = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", {}) or {}
        prefix = options.get("global_keyprefix", "")
        sep = options.get("sep", "\x06\x16")
        family = GaugeMetricFamily("gpumarket_queue_depth", "Messages waiting in a Celery queue (Redis LLEN).",
                                   labels=["queue"])
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        try:
            queues = list(self.queues())
            pipe = client.pipeline(transaction=False)
            for queue in queues:
                for step in PRIORITY_STEPS:
                    pipe.llen(f"{prefix}{queue}{sep}{step}" if step else f"{prefix}{queue}")
            lengths = pipe.execute()
        finally:
            client.close()
        per = len(PRIORITY_STEPS)
        for i, queue in enumerate(queues):
            family.add_metric([queue], sum(lengths[i * per:(i + 1) * per]))
        yield family


_scrape_collectors: dict[str, Collector] = {}
_session_permissions: dict[str, tuple[str, ...]] = {}


def register_scrape_collector(name: str, collector: Collector, permissions: Iterable[str] = ()) -> None:
    """Add a collector computed at each scrape (called once, at import, by the module that defines it).
    `permissions`: the view permissions of the records it counts, which a staff session needs to read the page (the
    admin's rule for those records; the bearer token reads it whole)."""
    _scrape_collectors[name] = collector
    _session_permissions[name] = tuple(permissions)


class _ScrapeTime(Collector):
    """The registered scrape-time collectors. One that fails (a database or Redis outage) is left out of the page
    and sets gpumarket_scrape_error{collector=<name>} to 1, instead of failing the whole scrape."""

    def collect(self) -> Iterator[Metric]:
        error = GaugeMetricFamily("gpumarket_scrape_error", "1 when a collector failed during this scrape.",
                                  labels=["collector"])
        for name, collector in list(_scrape_collectors.items()):
            try:
                metrics = list(collector.collect())
            except Exception as exc:  # noqa: BLE001 (whatever failed, the other collectors still report)
                log.warning("metrics: collector %s failed: %s: %s", name, type(exc).__name__, exc)
                error.add_metric([name], 1)
                continue
            error.add_metric([name], 0)
            yield from metrics
        yield error


def multiprocess_dir() -> str:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")


def exposition() -> bytes:
    """The text page: this host's processes' observations (multiprocess mode) or this process's, and the
    scrape-time collectors."""
    registry = CollectorRegistry()
    if multiprocess_dir():
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    else:
        registry.register(_ProcessRegistry())
    registry.register(_ScrapeTime())
    return generate_latest(registry)


class _ProcessRegistry(Collector):
    """This process's default registry (its histograms and counters, and the process/platform collectors)."""

    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()


# ------------------------------------------------------------------------------------------ access


class MetricsUnauthorized(Exception):
    pass


class MetricsForbidden(Exception):
    """A staff session without some of the view permissions of what the page counts."""

    def __init__(self, missing: list[str]):
        super().__init__(missing)
        self.missing = missing


def metrics_allowed(request: HttpRequest) -> bool:
    """True for the right bearer token, or a staff session holding every collector's view permissions; False
    (→ 404) without credentials; raises MetricsUnauthorized (→ 401) for a bearer token that is wrong or not
    accepted (no METRICS_TOKEN set), MetricsForbidden (→ 403) for a staff session short of a permission (found by
    review: any staff account, with no permission at all, read the fleet's figures here)."""
    header = request.headers.get("Authorization", "")
    if header:
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer":
            expected = settings.METRICS_TOKEN
            if expected and hmac.compare_digest(token.strip().encode(), expected.encode()):
                return True
            raise MetricsUnauthorized
    user = getattr(request, "user", None)
    if not (user is not None and user.is_authenticated and user.is_active and user.is_staff):
        return False
    missing = sorted({p for perms in _session_permissions.values() for p in perms if not user.has_perm(p)})
    if missing:
        raise MetricsForbidden(missing)
    return True


def metrics_view(request: HttpRequest) -> HttpResponse:
    """GET /metrics: the Prometheus text format, for the bearer token or a staff session with the permissions."""
    try:
        allowed = metrics_allowed(request)
    except MetricsUnauthorized:
        response = HttpResponse("Unauthorized: wrong metrics token.\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    except MetricsForbidden as exc:
        return HttpResponse("Forbidden: this page needs the permissions " + ", ".join(exc.missing) + ".\n",
                            status=403, content_type="text/plain")
    if not allowed:
        raise Http404
    if request.method not in ("GET", "HEAD"):
        response = HttpResponse(status=405)
        response["Allow"] = "GET, HEAD"
        return response
    return HttpResponse(exposition(), content_type=CONTENT_TYPE_PLAIN_0_0_4)  # the text format every Prometheus reads
