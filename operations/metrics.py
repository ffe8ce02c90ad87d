"""The platform's state for Prometheus, computed at each scrape with a few aggregate queries (core/metrics.py
serves the page and holds what the code observes as it runs).

- `gpumarket_meter_lag_seconds`: age of the oldest running time not yet metered (now − the earliest point up to
  which a running instance is billed; 0 when nothing runs). The meter bills every minute, so it stays near a
  minute; it grows when the meter stops, or for an instance whose node stopped answering (its time after the
  last health check is not billed until the node answers or the instance is interrupted).
- `gpumarket_meter_last_tick_age_seconds`: seconds since the last metering tick finished (absent before the
  first one, or with a per-process cache).
- `gpumarket_instances_running`;
- `gpumarket_nodes{state}`: nodes by state (every state, zeros included);
- `gpumarket_jobs_open{kind,status}` and `gpumarket_jobs_open_oldest_age_seconds{kind,status}`: open (queued,
  running) jobs by kind and state, and the age of the oldest of each. Finished jobs are not counted (the table
  keeps every job ever run; counting them at each scrape would read all of it);
- `gpumarket_stripe_events_unprocessed{status}` and `..._oldest_age_seconds{status}`: Stripe webhook events
  received but not processed yet, or whose processing failed;
- `gpumarket_queue_depth{queue}`: messages waiting in each Celery queue (core.metrics.QueueDepthCollector).

Five queries in all, each an aggregate served by an index or over a small table (nodes, open jobs, unprocessed
events): the page costs the same with 50 or 50,000 running instances, bar the one index range scan of
instance_status_idx.
"""
from collections.abc import Iterator

from celery import current_app
from django.db.models import Count, Min
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from billing.models import StripeEvent, StripeEventStatus
from core import metrics
from marketplace.models import Instance, InstanceStatus, Node, NodeState
from provisioning.models import OPEN, Job


class PlatformCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        now = timezone.now()
        yield from self._metering(now)
        yield from self._nodes()
        yield from self._jobs(now)
        yield from self._stripe_events(now)

    def _metering(self, now) -> Iterator[Metric]:
        running = Instance.objects.filter(status=InstanceStatus.RUNNING, started_at__isnull=False).aggregate(
            n=Count("id"), oldest=Min(Greatest(Coalesce("billed_until", "started_at"), "started_at")))
        lag = max((now - running["oldest"]).total_seconds(), 0.0) if running["oldest"] else 0.0
        yield GaugeMetricFamily("gpumarket_meter_lag_seconds",
                                "Age of the oldest running time not metered yet (0 when no instance runs).",
                                value=lag)
        yield GaugeMetricFamily("gpumarket_instances_running", "Instances running (billed).", value=running["n"])
        last = metrics.last_meter_tick()
        if last is not None:
            yield GaugeMetricFamily("gpumarket_meter_last_tick_age_seconds",
                                    "Seconds since the last metering tick finished.",
                                    value=max(now.timestamp() - last, 0.0))

    def _nodes(self) -> Iterator[Metric]:
        counts = dict.fromkeys(NodeState.values, 0)
        for row in Node.objects.order_by().values("state").annotate(n=Count("id")):
            counts[row["state"]] = row["n"]
        family = GaugeMetricFamily("gpumarket_nodes", "Nodes by state.", labels=["state"])
        for state, n in sorted(counts.items()):
            family.add_metric([state], n)
        yield family

    def _jobs(self, now) -> Iterator[Metric]:
        count = GaugeMetricFamily("gpumarket_jobs_open", "Open jobs (queued, running) by kind and state.",
                                  labels=["kind", "status"])
        age = GaugeMetricFamily("gpumarket_jobs_open_oldest_age_seconds",
                                "Age of the oldest open job of each kind and state.", labels=["kind", "status"])
        rows = Job.objects.filter(OPEN).order_by().values("kind", "status").annotate(n=Count("id"),
                                                                                    oldest=Min("created_at"))
        for row in sorted(rows, key=lambda r: (r["kind"], r["status"])):
            count.add_metric([row["kind"], row["status"]], row["n"])
            age.add_metric([row["kind"], row["status"]], max((now - row["oldest"]).total_seconds(), 0.0))
        yield count
        yield age

    def _stripe_events(self, now) -> Iterator[Metric]:
        count = GaugeMetricFamily("gpumarket_stripe_events_unprocessed",
                                  "Stripe webhook events received but not processed yet, or whose processing "
                                  "failed.", labels=["status"])
        age = GaugeMetricFamily("gpumarket_stripe_events_unprocessed_oldest_age_seconds",
                                "Age of the oldest such event.", labels=["status"])
        found = {row["status"]: row for row in StripeEvent.objects.order_by()
                 .filter(status__in=[StripeEventStatus.RECEIVED, StripeEventStatus.FAILED])
                 .values("status").annotate(n=Count("id"), oldest=Min("received_at"))}
        for status in (StripeEventStatus.FAILED, StripeEventStatus.RECEIVED):
            row = found.get(status)
            count.add_metric([status], row["n"] if row else 0)
            if row:
                age.add_metric([status], max((now - row["oldest"]).total_seconds(), 0.0))
        yield count
        yield age


def _queues() -> list[str]:
    return sorted(q.name for q in current_app.conf.task_queues or ())


# A staff session reads the page only with the view permissions of what it counts (core.metrics.metrics_allowed).
metrics.register_scrape_collector("platform", PlatformCollector(), permissions=[
    "marketplace.view_node", "marketplace.view_instance", "provisioning.view_job", "billing.view_stripeevent"])
metrics.register_scrape_collector("queues", metrics.QueueDepthCollector(_queues))

metrics_view = metrics.metrics_view
