"""Driving an instance's VM on its node: create, start, stop, restart, destroy.

Each function runs on a worker for one job, opens one SSH session for all its steps,
and reports through marketplace's instance services, which own the instance states
and the GPU allocations. Every step is idempotent on the node (the agent's `vm`
commands are), so a retried or redelivered job finishes what an earlier one began.
"""
from __future__ import annotations

import socket
import time
from typing import Any

from marketplace.models import Instance, InstanceStatus
from marketplace.services import instances as instance_svc
from marketplace.services import volumes as volume_svc
from provisioning.models import Job
from provisioning.services.nodes import node_session
from provisioning.services.runner import job_finish, job_step
from provisioning.ssh import NodeError, NodeSession

SSH_READY_TIMEOUT_S = 120


def _request(instance: Instance, **extra: Any) -> dict[str, Any]:
    return {"runtime": instance.node.runtime, "vm_id": instance.vm_id, **extra}


def _instance_id(job: Job) -> int:
    """The instance a VM job drives (job_create gives every instance job one)."""
    assert job.instance_id is not None, f"job {job.pk} ({job.kind}) has no instance"
    return job.instance_id


def wait_for_ssh(host: str, port: int, timeout: float = SSH_READY_TIMEOUT_S) -> None:
    """Wait until an SSH server answers on host:port with its banner, as a renter's client would see."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=3) as sock:
                sock.settimeout(3)
                if sock.recv(4).startswith(b"SSH-"):
                    return
                last = "no SSH banner"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.5)
    raise NodeError(f"The VM's SSH server at {host}:{port} did not answer within {timeout:.0f}s ({last}).")


def _progress(job: Job, instance: Instance, message: str) -> None:
    job_step(job, message)
    instance_svc.instance_set_status_message(instance_id=instance.pk, message=message)


def _running(job: Job, instance: Instance, answer: dict[str, Any], message: str) -> None:
    _progress(job, instance, "waiting for SSH on the VM")
    wait_for_ssh(answer["ssh_host"], answer["ssh_port"])
    instance_svc.instance_mark_running(instance_id=instance.pk, ssh_host=answer["ssh_host"],
                                       ssh_port=answer["ssh_port"], ssh_user=answer["ssh_user"], message=message)
    job_finish(job)


def vm_provision(job: Job) -> None:
    instance = instance_svc.instance_mark_provisioning(instance_id=_instance_id(job))
    if instance is None:
        job_finish(job, error="The instance is no longer waiting to be provisioned; nothing done.")
        return
    image = instance.image
    request = _request(
        instance,
        gpu_indices=instance_svc.instance_gpu_indices(instance=instance),
        ssh_public_keys=list(instance.ssh_public_keys),
        image={"docker": image.docker_image, "libvirt": image.libvirt_image},
        disk_gb=instance.disk_gb,
    )
    volumes = volume_svc.volume_agent_specs(instance=instance)
    if volumes:  # [{"name": "vol-...", "mount": "/data"}]: created on this node before (marketplace.services.volumes)
        request["volumes"] = volumes
    _progress(job, instance, f"connecting to node {instance.node_id}")
    with node_session(instance.node) as session:
        _progress(job, instance, "creating the VM")
        answer = session.agent("vm", "create", request)
    _running(job, instance, answer, "Running")


def _instance_in(job: Job, status: str, doing: str) -> Instance | None:
    """The job's instance if it is still `status`; otherwise close the job as having nothing to do."""
    instance = Instance.objects.select_related("node").get(pk=_instance_id(job))
    if instance.status != status:
        job_finish(job, error=f"The instance is {instance.status}, not {doing}; nothing done.")
        return None
    return instance


def _start(session: NodeSession, instance: Instance) -> dict[str, Any]:
    # The GPUs it holds now: after a stop they may differ from the ones the VM had before.
    return session.agent("vm", "start", _request(
        instance, gpu_indices=instance_svc.instance_gpu_indices(instance=instance)))


def vm_start(job: Job) -> None:
    if (instance := _instance_in(job, InstanceStatus.STARTING, "starting")) is None:
        return
    with node_session(instance.node) as session:
        _progress(job, instance, "starting the VM")
        answer = _start(session, instance)
    _running(job, instance, answer, "Running")


def vm_restart(job: Job) -> None:
    if (instance := _instance_in(job, InstanceStatus.STARTING, "restarting")) is None:
        return
    with node_session(instance.node) as session:
        _progress(job, instance, "stopping the VM for a restart")
        session.agent("vm", "stop", _request(instance))
        _progress(job, instance, "starting the VM again")
        answer = _start(session, instance)
    _running(job, instance, answer, "Running (restarted)")


def vm_stop(job: Job) -> None:
    if (instance := _instance_in(job, InstanceStatus.STOPPING, "stopping")) is None:
        return
    with node_session(instance.node) as session:
        _progress(job, instance, "stopping the VM (the disk is kept)")
        session.agent("vm", "stop", _request(instance))
    instance_svc.instance_mark_stopped(instance_id=instance.pk, message="Stopped; the disk is kept.")
    job_finish(job)


def vm_destroy(job: Job) -> None:
    if (instance := _instance_in(job, InstanceStatus.DESTROYING, "destroying")) is None:
        return
    with node_session(instance.node) as session:
        _progress(job, instance, "destroying the VM and its disk")
        session.agent("vm", "destroy", _request(instance))
    instance_svc.instance_mark_destroyed(instance_id=instance.pk)
    job_finish(job)


def vm_destroy_failed(*, job: Job, error: NodeError) -> None:
    """A destroy that could not reach the node: the renter's side ends all the same (nothing is billed after
    the request); the instance keeps its GPUs until the reconciler removes the VM when the node answers."""
    instance = Instance.objects.get(pk=_instance_id(job))
    if instance.status != InstanceStatus.DESTROYING:  # it moved on meanwhile (e.g. an operator's action)
        job_finish(job, error=error.message)
        return
    instance_svc.instance_mark_destroyed(instance_id=instance.pk, cleanup_pending=True)
    job_finish(job, error=f"{error.message} The instance was destroyed for its renter; the VM is removed when "
                          "the node answers again.")


def vm_failed(job: Job, error: str) -> None:
    """A job gave up: the instance fails and its GPUs are released, so the VM must not keep them.

    A VM that never became running is destroyed; an existing one is stopped (its disk is kept
    for the renter to destroy). An unreachable node is left to the reconciler.
    """
    instance = instance_svc.instance_mark_failed(instance_id=_instance_id(job), message=error)
    job_finish(job, error=error)
    verb = "destroy" if instance.started_at is None else "stop"
    try:
        with node_session(instance.node) as session:
            session.agent("vm", verb, _request(instance))
    except NodeError:
        pass  # unreachable now: the reconciler cleans up when the node answers again
