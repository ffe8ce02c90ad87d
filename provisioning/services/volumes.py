"""Creating and deleting volumes on their nodes (the agent's `volume create` and `volume delete`, both idempotent),
reporting through marketplace.services.volumes, which owns the volumes' states."""
from __future__ import annotations

from marketplace.models import Volume, VolumeState
from marketplace.services import volumes as volume_svc
from provisioning.models import Job, JobKind
from provisioning.services.nodes import node_session
from provisioning.services.runner import job_finish, job_step
from provisioning.ssh_errors import AgentFailed, NodeError


def _volume(job: Job) -> Volume:
    assert job.volume_id is not None, f"job {job.pk} ({job.kind}) has no volume"
    return Volume.objects.select_related("node").get(pk=job.volume_id)


def volume_create_run(*, job: Job) -> None:
    volume = _volume(job)
    if volume.state != VolumeState.CREATING:
        job_finish(job=job, error=f"The volume is {volume.state}, not creating; nothing done.")
        return
    job_step(job=job, message=f"creating {volume.name} ({volume.size_gb} GB) on node {volume.node_id}")
    with node_session(volume.node) as session:
        session.agent("volume", "create", {"name": volume.name, "size_gb": volume.size_gb})
    volume_svc.volume_mark_available(volume_id=volume.pk)
    job_finish(job=job)


def volume_delete_run(*, job: Job) -> None:
    volume = _volume(job)
    if volume.state != VolumeState.DELETING:
        job_finish(job=job, error=f"The volume is {volume.state}, not deleting; nothing done.")
        return
    job_step(job=job, message=f"deleting {volume.name} on node {volume.node_id}")
    try:
        with node_session(volume.node) as session:
            session.agent("volume", "delete", {"name": volume.name})
    except AgentFailed as exc:
        if exc.code != "volume_in_use":
            raise
        volume_svc.volume_delete_refused(volume_id=volume.pk, message=f"its node says: {exc.message}")
        job_finish(job=job, error=exc.message)
        return
    volume_svc.volume_mark_deleted(volume_id=volume.pk)
    job_finish(job=job)


def volume_job_failed(*, job: Job, error: NodeError | str) -> None:
    """A volume job gave up (the node stayed unreachable, or the reaper): a creation fails (nothing was billed);
    a deletion is undone (the volume still exists on its node, and is billed again)."""
    message = error.message if isinstance(error, NodeError) else error
    if job.volume_id is not None:
        if job.kind == JobKind.VOLUME_CREATE:
            volume_svc.volume_mark_failed(volume_id=job.volume_id, message=message)
        else:
            volume_svc.volume_delete_refused(volume_id=job.volume_id, message=message)
    job_finish(job=job, error=message)
