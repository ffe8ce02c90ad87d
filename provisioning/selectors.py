"""Reads of provisioning's rows for other layers (the nodes API shows a node's current job)."""
from collections.abc import Iterable

from django.db.models import Max

from provisioning.models import Job, JobKind, JobStatus, VerificationRun


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
