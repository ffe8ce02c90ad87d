"""Reads of provisioning's rows for other layers (the nodes API shows a node's current job) and for the
verification service (a GPU model's fleet reference)."""
from __future__ import annotations

from collections.abc import Iterable

from django.conf import settings
from django.db.models import Max

from marketplace.models import NodeState
from marketplace.models.nodes import LISTABLE_VERDICTS
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


def fleet_reference(gpu_model_id: int, exclude_node_id: int | None = None) -> FleetReference | None:
    """What the model measures across the platform: each live node's latest verification, when it was verified or
    degraded and measured its GPUs on CUDA, gives its per-GPU medians; their median and MAD per figure (the
    acceptance policy's FleetReference). None below settings.FLEET_REFERENCE_MIN_NODES such nodes.
    `exclude_node_id`: the node being judged, left out of its own reference. One query."""
    latest = (VerificationRun.objects.filter(node__gpu_model_id=gpu_model_id)
              .exclude(node__state__in=(NodeState.RETIRED, NodeState.REJECTED))
              .order_by("node_id", "-created_at", "-id").distinct("node_id")
              .values_list("node_id", "verdict", "figures__device", "figures__median"))
    medians = [median for node_id, verdict, device, median in latest
               if node_id != exclude_node_id and verdict in LISTABLE_VERDICTS and device == "cuda" and median]
    if len(medians) < settings.FLEET_REFERENCE_MIN_NODES:
        return None
    return FleetReference.from_node_medians(medians)
