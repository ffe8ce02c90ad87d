"""An instance job opened before its node was quarantined (its SSH host key changed), run after it.

The job's session meets the changed key (HostKeyMismatch) and the job gives up without touching the VM (vms.vm_failed).
Before, a stop or restart then put the instance back to running ("It is still running (and billed); stop it
again"): running on a node the platform no longer checks, which node_quarantine had interrupted every running
instance of (billing stopped at its last healthy moment, the renter credited and told); this one escaped it,
being `stopping` or `starting` then. Now it ends as the renter's verbs there end: a stop stopped (its GPUs held
until the node's reconcile after the key is accepted confirms the VM stopped), a restart interrupted as its
node's running instances were. A provision fails and a start is stopped again, as before (nothing was made or
started; the GPUs freed).

Real parts: a simulated server over real SSH whose host key really changes (round47_quarantine_sim), the fleet's
health check, the API, the jobs as worker deliveries, PostgreSQL."""
import pytest

from marketplace.models import GpuAllocation, Instance, InstanceStatus, Interruption
from provisioning import tasks
from provisioning.models import Job, JobKind
from tests.marketplace.renting_helpers import ed25519_key
from tests.marketplace.sim_renting import deliver_until_closed, sent_jobs_fixture  # noqa: F401 (fixture)

from .round47_quarantine_sim import (  # noqa: F401 (fixtures)
    funded_renter,
    instance_running_via_api,
    qnode_fixture,
    simbase_fixture,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

URL = "/api/v1/instances/"


def _run(kind: str, instance: Instance) -> Instance:
    task = {JobKind.INSTANCE_STOP: tasks.instance_stop, JobKind.INSTANCE_RESTART: tasks.instance_restart,
            JobKind.INSTANCE_START: tasks.instance_start, JobKind.INSTANCE_PROVISION: tasks.instance_provision}[kind]
    deliver_until_closed(task, Job.objects.filter(instance=instance, kind=kind).latest("pk"))
    instance.refresh_from_db()
    return instance


def test_a_stop_opened_before_the_quarantine_does_not_leave_the_instance_running(qnode, client_for):
    client = client_for(funded_renter())
    instance = instance_running_via_api(client, qnode.node)
    assert client.post(f"{URL}{instance.pk}/stop/").status_code == 202  # its job waits for a worker
    qnode.quarantined_by_a_health_check()

    instance = _run(JobKind.INSTANCE_STOP, instance)
    assert instance.status == InstanceStatus.STOPPED, instance.status_message
    assert "host key" in instance.status_message and "stop it again" not in instance.status_message
    # The VM was never reached: its GPU stays held until the node confirms it stopped.
    assert instance.vm_cleanup_pending and GpuAllocation.objects.filter(instance=instance,
                                                                        released_at__isnull=True).exists()


def test_a_restart_opened_before_the_quarantine_ends_interrupted_as_the_nodes_running_instances(qnode, client_for):
    client = client_for(funded_renter())
    instance = instance_running_via_api(client, qnode.node)
    assert client.post(f"{URL}{instance.pk}/restart/").status_code == 202  # billing pauses for the restart
    billed = Instance.objects.values_list("billed_seconds", flat=True).get(pk=instance.pk)
    qnode.quarantined_by_a_health_check()

    instance = _run(JobKind.INSTANCE_RESTART, instance)
    assert instance.status == InstanceStatus.INTERRUPTED, instance.status_message
    assert Interruption.objects.filter(instance=instance, ended_at__isnull=True).exists()
    assert instance.billed_seconds == billed  # nothing billed on a node nobody sees


# ------------------------------------------------------------------------- coverage: these were right before

def test_a_provision_opened_before_the_quarantine_fails_unbilled_its_gpu_freed(qnode, client_for):
    client = client_for(funded_renter())
    answer = client.post(URL, {"offer": qnode.node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                               "ssh_public_key": ed25519_key()}, format="json")
    assert answer.status_code == 201, answer.content
    instance = Instance.objects.get(pk=answer.json()["id"])
    qnode.quarantined_by_a_health_check()

    instance = _run(JobKind.INSTANCE_PROVISION, instance)
    assert instance.status == InstanceStatus.FAILED and "host key" in instance.status_message
    assert instance.billed_seconds == 0 and not instance.vm_cleanup_pending
    assert not GpuAllocation.objects.filter(instance=instance, released_at__isnull=True).exists()


def test_a_start_opened_before_the_quarantine_leaves_it_stopped_its_gpu_freed(qnode, client_for):
    client = client_for(funded_renter())
    instance = instance_running_via_api(client, qnode.node)
    assert client.post(f"{URL}{instance.pk}/stop/").status_code == 202
    instance = _run(JobKind.INSTANCE_STOP, instance)
    assert instance.status == InstanceStatus.STOPPED
    assert client.post(f"{URL}{instance.pk}/start/").status_code == 202
    qnode.quarantined_by_a_health_check()

    instance = _run(JobKind.INSTANCE_START, instance)
    assert instance.status == InstanceStatus.STOPPED and "host key" in instance.status_message
    assert not GpuAllocation.objects.filter(instance=instance, released_at__isnull=True).exists()
