"""Reads of provisioning's rows for other layers (the nodes API shows a node's current job) and for the
verification service (a GPU model's fleet reference)."""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import replace

from django.conf import settings
from django.db.models import Max

from marketplace.models import NodeState
from marketplace.models.nodes import Verdict
from marketplace.stored_figures import run_figures
from provisioning.models import Job, JobKind, JobStatus, VerificationRun
from provisioning.verification.performance import FleetReference


def latest_jobs(node_ids: list[int]) -> dict[int, Job]:
    """The most recent job of each node, in two queries whatever the number of nodes."""
    latest = Job.objects.filter(node_id__in=node_ids).values("node_id").annotate(last=Max("id"))
    jobs = Job.objects.filter(id__in=[row["last"] for row in latest])
    return {job.node_id: job for job in jobs}


def verification_runs_of(jobs: Iterable[Job | None]) -> dict[int, VerificationRun]:
    """The verification each finished verify job recorded, by job id, in one query.

    A verify job "succeeds" when the check ran, whatever it found: the run's verdict is what to show.
    """
    ids = [j.pk for j in jobs if j is not None and j.kind == JobKind.NODE_VERIFY and j.status == JobStatus.SUCCEEDED]
    runs = VerificationRun.objects.filter(job_id__in=ids) if ids else VerificationRun.objects.none()
    return {run.job_id: run for run in runs if run.job_id is not None}  # not None: filtered on it


def fleet_reference(gpu_model_id: int, exclude_node_id: int | None = None,
                    exclude_provider_id: int | None = None) -> FleetReference | None:
    """What the model measures across the platform: each live node's latest verification, when it was verified
    and measured its GPUs on CUDA, gives its per-GPU medians. Each provider counts once (the median of its nodes),
    and the reference is the median and MAD over providers (the acceptance policy's FleetReference). None below
    settings.FLEET_REFERENCE_MIN_NODES such nodes or FLEET_REFERENCE_MIN_PROVIDERS providers.

    Degraded nodes do not count: those degraded for sitting below the fleet would drag its median down to them;
    and one provider's many nodes would make it (found by review). `exclude_node_id`, `exclude_provider_id`: the
    node being judged and its provider, never part of its own reference. One query."""
    latest = (VerificationRun.objects.filter(node__gpu_model_id=gpu_model_id)
              .exclude(node__state__in=(NodeState.RETIRED, NodeState.REJECTED))
              .order_by("node_id", "-created_at", "-id").distinct("node_id")
              .values_list("node_id", "node__provider_id", "verdict", "figures__device", "figures__median"))
    by_provider: dict[int, list[dict[str, float]]] = defaultdict(list)
    for node_id, provider_id, verdict, device, stored in latest:
        # The stored medians read well-typed (stored_figures.run_figures: numbers only): one run's medians that are
        # a list or hold text were a TypeError in every verification of the model (found by review).
        median = run_figures({"median": stored}).get("median")
        if node_id != exclude_node_id and provider_id != exclude_provider_id and verdict == Verdict.VERIFIED \
                and device == "cuda" and median:
            by_provider[provider_id].append(median)
    nodes = sum(map(len, by_provider.values()))
    if nodes < settings.FLEET_REFERENCE_MIN_NODES or len(by_provider) < settings.FLEET_REFERENCE_MIN_PROVIDERS:
        return None
    per_provider = [FleetReference.from_node_medians(medians).median for medians in by_provider.values()]
    reference = FleetReference.from_node_medians(per_provider)
    # Each figure by the same minimums: one measured by few (a figure new to the runs, platform_bf16_tflops) would
    # be the first re-verified node's alone, its MAD 0 (found by review).
    nodes_with = Counter(key for medians in by_provider.values() for median in medians for key in median
                         if median[key])
    providers_with = Counter(key for median in per_provider for key in median)
    kept = {key for key in reference.median if nodes_with[key] >= settings.FLEET_REFERENCE_MIN_NODES
            and providers_with[key] >= settings.FLEET_REFERENCE_MIN_PROVIDERS}
    if not kept:
        return None
    return replace(reference, nodes=nodes, providers=len(by_provider),
                   median={k: v for k, v in reference.median.items() if k in kept},
                   mad={k: v for k, v in reference.mad.items() if k in kept})
