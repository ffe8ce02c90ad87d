"""Creating and deleting volumes on their nodes (the agent's `volume create` and `volume delete`, both idempotent),
reporting through marketplace.services.volumes, which owns the volumes' states."""
from __future__ import annotations

from marketplace.models import Volume, VolumeState
from marketplace.services import volumes as volume_svc
from provisioning.models import Job, JobFault, JobKind
from provisioning.services.faults import error_fault
from provisioning.services.nodes import disk_limit_not_enforced_noted, node_session
from provisioning.services.runner import job_finish, job_step
from provisioning.ssh_errors import AgentFailed, NodeError


def _volume(job: Job) -> Volume:
    assert job.volume_id is not None, f"job {job.pk} ({job.kind}) has no volume"
    return Volume.objects.select_related("node").get(pk=job.volume_id)


def volume_create_run(*, job: Job) -> None:
    volume = _volume(job)
    if volume.state == VolumeState.AVAILABLE:  # an earlier delivery made it, its worker lost before it closed
        job_finish(job=job, note="the volume is available already")
        return
    if volume.state != VolumeState.CREATING:
        job_finish(job=job, error=f"The volume is {volume.state}, not creating; nothing done.",
                   fault=_superseded_by(volume))
        return
    job_step(job=job, message=f"creating {volume.name} ({volume.size_gb} GB) on node {volume.node_id}")
    with node_session(volume.node) as session:
        answer = session.agent("volume", "create", {"name": volume.name, "size_gb": volume.size_gb})
    if answer.get("size_limit") == "not_enforced":  # the node's word: operators see it (once per node)
        disk_limit_not_enforced_noted(node=volume.node, what=f"Volume {volume.name} ({volume.size_gb} GB)")
    volume_svc.volume_mark_available(volume_id=volume.pk)
    job_finish(job=job)


def volume_delete_run(*, job: Job) -> None:
    volume = _volume(job)
    if volume.state == VolumeState.DELETED:  # as above: deleted by an earlier delivery
        job_finish(job=job, note="the volume is deleted already")
        return
    if volume.state != VolumeState.DELETING:
        job_finish(job=job, error=f"The volume is {volume.state}, not deleting; nothing done.",
                   fault=_superseded_by(volume))
        return
    job_step(job=job, message=f"deleting {volume.name} on node {volume.node_id}")
    try:
        with node_session(volume.node) as session:
            session.agent("volume", "delete", {"name": volume.name})
    except AgentFailed as exc:
        if exc.code != "volume_in_use":
            raise
        volume_svc.volume_delete_refused(volume_id=volume.pk, message=f"its node says: {exc.message}")
        # A VM the platform made still mounts it there (not removed yet): the platform asked too soon.
        job_finish(job=job, error=exc.message, fault=JobFault.PLATFORM)
        return
    volume_svc.volume_mark_deleted(volume_id=volume.pk)
    job_finish(job=job)


def _superseded_by(volume: Volume) -> str:
    """Whose doing it is that a volume job has nothing left to do: the renter's delete, or the platform's own
    change (the reaper failed it, a delete was refused). Never the node's: nothing was asked of it."""
    return JobFault.RENTER if volume.state in (VolumeState.DELETING, VolumeState.DELETED) else JobFault.PLATFORM


def volume_job_failed(*, job: Job, error: NodeError) -> None:
    """A volume job gave up (the node stayed unreachable, or the reaper): a creation fails (nothing was billed);
    a deletion stays asked for (volume_delete_waiting: not billed past the request, finished by the reconciler
    when the node answers). Only the node's refusal undoes a deletion (volume_delete_run): without an answer
    nothing says the volume must stay, and the renter asked for it to go."""
    message = error.message
    if job.volume_id is not None:
        if job.kind == JobKind.VOLUME_CREATE:
            volume_svc.volume_mark_failed(volume_id=job.volume_id, message=message)
        else:
            volume_svc.volume_delete_waiting(volume_id=job.volume_id, message=message,
                                             answered=isinstance(error, AgentFailed))
    job_finish(job=job, error=message, fault=error_fault(error))
