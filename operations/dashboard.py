"""The operators' dashboard on the admin's front page: fleet figures, what needs attention, and charts.

Reads only, across every app (nodes and instances from marketplace, jobs and events from provisioning, revenue
from billing's ledger): that is why it lives in `operations`, above the apps, and not in one of them. Shown by the
admin index template (operations/templates/admin/gpumarket_index.html) through the `fleet_dashboard` template tag,
each part to those the admin lets view the records it is made of only (PARTS).
"""
from collections.abc import Collection
from datetime import timedelta

from django.contrib import admin
from django.db.models import BooleanField, Case, Count, Q, Value, When
from django.urls import reverse
from django.utils import timezone

from billing.models import LedgerTransaction, Payout, Refund, TopUp
from billing.selectors import revenue_between, waiting_on_stripe
from core import charts
from marketplace.models import Gpu, GpuStatus, Instance, InstanceStatus, Node, NodeState, Verdict
from marketplace.models.nodes import offerable
from provisioning.models import OPEN_JOB_STATUSES, Job, JobFault, JobKind, JobStatus, NodeEvent, VerificationRun

STATE_CSS = {
    NodeState.ACTIVE: "ok", NodeState.VERIFYING: "", NodeState.PENDING: "neutral", NodeState.MAINTENANCE: "warn",
    NodeState.REJECTED: "bad", NodeState.OFFLINE: "bad", NodeState.QUARANTINED: "bad", NodeState.RETIRED: "neutral",
}
LIST_LIMIT = 10
# free: on a node renters can book now; mig: split into MIG slices (rented slice by slice, never whole)
GPU_COLUMNS = ("free", "rented", "mig", "not_offered", "unavailable")
CRITICAL_KINDS = ("offline",)  # node events listed as critical whatever their level


def _short(label: str) -> str:
    """"Rejected by the benchmark check" -> "Rejected"; "Pending: waiting for ..." -> "Pending"."""
    return label.split(":")[0].split(" by ")[0]


def _changelist(model: str, **filters) -> str:
    url = reverse(f"admin:{model}_changelist")
    if filters:
        url += "?" + "&".join(f"{k}={v}" for k, v in filters.items())
    return url


def revenue_figures(now=None) -> dict:
    """Revenue today and this month (UTC), from billing's ledger (billing.selectors.revenue_between: integer
    micro-dollars under "charged_micros", what renters paid for GPU time and storage, and "fee_micros", what the
    platform-revenue account received; both net of reversals)."""
    now = now or timezone.now()
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    month = day.replace(day=1)
    return {"today": revenue_between(start=day, end=now), "month": revenue_between(start=month, end=now)}


# Each part of the dashboard and the model whose records it is made of: shown to those the admin lets view them (found
# by review: any staff account, with no permission at all, read the revenue, providers' addresses and nodes' error
# text). The admin's own rule (the registered ModelAdmin's has_view_permission: the view or the change permission,
# or an admin's own), not the view permission alone: an operator holding only a model's change permission opens its
# list and pages, and saw none of its parts here (found by review). A part not shown is not computed either.
PARTS = {
    "nodes": Node,  # counts by state, rejected and offline nodes (their providers, errors)
    "gpus": Gpu,
    "instances": Instance,
    "jobs": Job,
    "events": NodeEvent,
    "runs": VerificationRun,
    "revenue": LedgerTransaction,
    # Money whose Stripe answer is still unknown past the follow-up's delay (billing.selectors.waiting_on_stripe)
    "payouts": Payout,
    "refunds": Refund,
    "top_ups": TopUp,
}
WAITING_ON_STRIPE = {  # part: (its changelist, the filter of the rows it counts)
    # As counted: past the follow-up's delay (past_delay=yes: rows still inside it were listed, not counted), and
    # not the payouts held (review r54).
    "payouts": ("billing_payout", {"status__exact": "pending", "held": "no", "past_delay": "yes"}),
    "refunds": ("billing_refund", {"status__exact": "pending", "past_delay": "yes"}),
    "top_ups": ("billing_topup", {"stripe": "waiting", "past_delay": "yes"}),
}


def parts_for(request) -> frozenset[str]:
    """The parts the request's user may read: those whose model the admin site lets them view (a superuser all; an
    inactive account none; a model the site does not register, none)."""
    site = admin.site
    return frozenset(part for part, model in PARTS.items()
                     if site.is_registered(model) and site.get_model_admin(model).has_view_permission(request))


def fleet_figures(parts: Collection[str], now=None) -> dict:
    """The figures of the given parts (PARTS) only, with "parts" itself."""
    now = now or timezone.now()
    day_ago, week_ago = now - timedelta(days=1), now - timedelta(days=7)
    figures: dict = {"now": now, "parts": frozenset(parts)}
    if "nodes" in parts:
        figures.update(_nodes())
    if "gpus" in parts:
        figures.update(_gpus())
    if "instances" in parts:
        figures.update(_instances())
    if "jobs" in parts:
        figures.update(_jobs(now, day_ago))
    if "runs" in parts:
        figures["rejected_runs_week"] = VerificationRun.objects.filter(verdict=Verdict.REJECTED,
                                                                       created_at__gte=week_ago).count()
        figures["rejected_runs_url"] = _changelist("provisioning_verificationrun", verdict__exact=Verdict.REJECTED,
                                                   made="7d")
    if "events" in parts:
        # Critical: events marked so, and a node going offline (its renters' instances are cut off).
        figures["critical_events"] = list(
            NodeEvent.objects.filter(Q(level=NodeEvent.Level.CRITICAL) | Q(kind__in=CRITICAL_KINDS),
                                     created_at__gte=week_ago).select_related("node")[:LIST_LIMIT])
    if "revenue" in parts:
        figures["revenue"] = revenue_figures(now)
    # Each only while something waits: a payout or refund whose lookup Stripe keeps refusing stays pending with
    # nothing else to tell an operator (a warning in the worker's log, every minute).
    figures["waiting"] = [
        {"part": part, **waiting, "url": _changelist(model, **filters)}
        for part, (model, filters) in WAITING_ON_STRIPE.items()
        if part in parts and (waiting := waiting_on_stripe(kind=part, now=now))["count"]]
    return figures


def _nodes() -> dict:
    by_state = dict(Node.objects.order_by().values_list("state").annotate(n=Count("id")))
    states = [{"state": s, "label": s.label, "count": by_state.get(s.value, 0),
               "url": _changelist("marketplace_node", state__exact=s.value)} for s in NodeState]
    rejected = (Node.objects.filter(verdict=Verdict.REJECTED).exclude(state=NodeState.RETIRED)
                .select_related("provider", "gpu_model").order_by("-state_changed_at"))
    offline = (Node.objects.filter(state=NodeState.OFFLINE).select_related("provider", "gpu_model")
               .order_by("-state_changed_at"))
    return {
        "nodes_total": sum(s["count"] for s in states if s["state"] != NodeState.RETIRED),
        "states": states,
        "rejected_count": rejected.count(),
        "rejected": list(rejected[:LIST_LIMIT]),
        # Each list as counted: not retired (retired=no; it listed retired nodes too: review r54).
        "rejected_url": _changelist("marketplace_node", verdict__exact=Verdict.REJECTED, retired="no"),
        "degraded_count": Node.objects.filter(verdict=Verdict.DEGRADED).exclude(state=NodeState.RETIRED).count(),
        "degraded_url": _changelist("marketplace_node", verdict__exact=Verdict.DEGRADED, retired="no"),
        "offline_count": offline.count(),
        "offline": list(offline[:LIST_LIMIT]),
        "offline_url": _changelist("marketplace_node", state__exact=NodeState.OFFLINE),
        "state_chart": charts.hbar_chart(
            [charts.Group("", [charts.Bar(_short(s["state"].label), s["count"], STATE_CSS.get(s["state"], ""),
                                          str(s["count"])) for s in states])],
            title="Nodes by state"),
    }


def _gpus() -> dict:
    # "Free" means bookable: a free GPU of a node renters cannot book (rejected, offline, pending, unlisted, ...:
    # the offers' rule, OFFERABLE) is counted as "not offered" instead.
    per_model: dict[str, dict] = {}
    offered = Case(When(node_id__in=Node.objects.filter(offerable()).values("pk"), then=Value(True)),
                   default=Value(False), output_field=BooleanField())
    gpu_rows = (Gpu.objects.exclude(node__state=NodeState.RETIRED).order_by()
                .values_list("gpu_model__name", "gpu_model_id", "status").annotate(offered=offered, n=Count("id")))
    for name, model_id, status, is_offered, n in gpu_rows:
        row = per_model.setdefault(name, {"name": name, "model_id": model_id, **dict.fromkeys(GPU_COLUMNS, 0)})
        row["not_offered" if status == GpuStatus.FREE and not is_offered else status] += n
    models = sorted(per_model.values(), key=lambda r: (-sum(r[c] for c in GPU_COLUMNS), r["name"]))
    for row in models:
        row["url"] = _changelist("marketplace_gpu", gpu_model__id__exact=row["model_id"])
    return {
        "gpus": {c: sum(r[c] for r in models) for c in GPU_COLUMNS},
        # The free GPUs as counted (marketplace.admin.nodes.BookableFilter): status=free listed those of nodes not
        # offered too (review r54).
        "gpus_free_url": _changelist("marketplace_gpu", bookable="yes"),
        "gpu_models": models,
        "gpu_chart": charts.stacked_bar_chart(
            [(r["name"], [charts.Segment(r["rented"], "rented", "rented"), charts.Segment(r["free"], "free", "free"),
                          charts.Segment(r["mig"], "mig", "split into MIG slices"),
                          charts.Segment(r["not_offered"], "not-offered", "not offered"),
                          charts.Segment(r["unavailable"], "unavailable", "unavailable")]) for r in models],
            title="GPUs by model: rented, free (bookable), split into MIG slices, not offered, unavailable"),
    }


def _instances() -> dict:
    instances = dict(Instance.objects.exclude(status=InstanceStatus.DESTROYED).order_by()
                     .values_list("status").annotate(n=Count("id")))
    return {
        "instances_running": instances.get(InstanceStatus.RUNNING, 0),
        "instances_live": sum(n for s, n in instances.items() if s != InstanceStatus.FAILED),
        "instances_failed": instances.get(InstanceStatus.FAILED, 0),
    }


def _jobs(now, day_ago) -> dict:
    stuck = (Job.objects.filter(status__in=OPEN_JOB_STATUSES, deadline__lt=now)
             .select_related("node", "instance").order_by("deadline"))
    return {
        "stuck_count": stuck.count(),
        "stuck": list(stuck[:LIST_LIMIT]),
        "stuck_url": _changelist("provisioning_job", stuck="yes"),
        "open_jobs": Job.objects.filter(status__in=OPEN_JOB_STATUSES).count(),
        # The node's failures (provisioning.services.faults: what counts against a node) apart from the platform's
        # own, which are the platform's trouble to look into.
        "failed_verify_jobs_day": Job.objects.filter(kind=JobKind.NODE_VERIFY, status=JobStatus.FAILED,
                                                     fault=JobFault.NODE, finished_at__gte=day_ago).count(),
        # Each list as counted: finished in the last 24 h (finished=24h), the node's of its kind (review r54: they
        # listed every failure ever made, the node's of every kind).
        "failed_jobs_url": _changelist("provisioning_job", status__exact=JobStatus.FAILED,
                                       fault__exact=JobFault.NODE, kind__exact=JobKind.NODE_VERIFY, finished="24h"),
        "platform_failed_jobs_day": Job.objects.filter(status=JobStatus.FAILED, fault=JobFault.PLATFORM,
                                                       finished_at__gte=day_ago).count(),
        "platform_failed_jobs_url": _changelist("provisioning_job", status__exact=JobStatus.FAILED,
                                                fault__exact=JobFault.PLATFORM, finished="24h"),
        # Jobs that met a changed SSH host key their node is quarantined for already (counted once, by the
        # quarantine): neither the node's count nor the platform's takes them, so without their own they were
        # nowhere on the dashboard while the new keys waited for an operator.
        "host_key_jobs_day": Job.objects.filter(status=JobStatus.FAILED, fault=JobFault.HOST_KEY,
                                                finished_at__gte=day_ago).count(),
        "host_key_jobs_url": _changelist("provisioning_job", status__exact=JobStatus.FAILED,
                                         fault__exact=JobFault.HOST_KEY, finished="24h"),
    }
