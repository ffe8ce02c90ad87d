"""A job opened before its node was quarantined (its SSH host key changed), run after it, meets the changed key.

The quarantine has counted the change once: its critical host_key_changed event, and the failure of the job or check
that met it first. Before, every job that met the same key afterwards (a stop, restart, start, provision, destroy,
volume create or delete queued before the quarantine) failed with fault=node, held against the provider's
reliability once more, and quarantined the node again: another critical event for the one change. Now the same key
seen again on a quarantined node records nothing (provisioning.services.nodes.node_quarantine) and the job fails
with the changed key's fault (JobFault.HOST_KEY, nodes.HostKeyStillChanged; first recorded as the platform's); a
third key, neither pinned nor the one recorded, is new and is recorded and counted as before. A start that failed
so told the renter "start it again", which is refused there until the key is accepted; it now says so.

Real parts: a simulated server over real SSH whose host key really changes (round47_quarantine_sim), the fleet's
health check, the API, the jobs as worker deliveries, PostgreSQL."""
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.models import Instance, InstanceStatus, Volume, VolumeState
from provisioning import tasks
from provisioning.models import Job, JobFault, JobKind, JobStatus
from provisioning.services.reliability import failed_jobs_counted
from tests.marketplace.renting_helpers import ed25519_key
from tests.marketplace.sim_renting import deliver, deliver_until_closed, sent_jobs_fixture  # noqa: F401 (fixture)

from .round47_quarantine_sim import (  # noqa: F401 (fixtures)
    funded_renter,
    instance_running_via_api,
    jobs_held_against,
    qnode_fixture,
    simbase_fixture,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

URL = "/api/v1/instances/"
VOLUMES = "/api/v1/volumes/"
TASKS = {JobKind.INSTANCE_STOP: tasks.instance_stop, JobKind.INSTANCE_RESTART: tasks.instance_restart,
         JobKind.INSTANCE_START: tasks.instance_start, JobKind.INSTANCE_PROVISION: tasks.instance_provision,
         JobKind.INSTANCE_DESTROY: tasks.instance_destroy, JobKind.VOLUME_CREATE: tasks.volume_create,
         JobKind.VOLUME_DELETE: tasks.volume_delete}


def _counted(node) -> int:
    """The node's failed jobs its reliability figure takes off (fleet_record)."""
    return failed_jobs_counted(since=timezone.now() - timedelta(days=30)).filter(node_id=node.pk).count()


def _figures(qnode) -> tuple[int, int, int]:
    node = qnode.fresh()
    return qnode.critical_events(), jobs_held_against(node), _counted(node)


def _stopped(client, qnode) -> Instance:
    instance = instance_running_via_api(client, qnode.node)
    assert client.post(f"{URL}{instance.pk}/stop/").status_code == 202
    deliver_until_closed(tasks.instance_stop, Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.STOPPED, instance.status_message
    return instance


def _open_stop(client, qnode) -> Job:
    instance = instance_running_via_api(client, qnode.node)
    assert client.post(f"{URL}{instance.pk}/stop/").status_code == 202
    return Job.objects.get(instance=instance, kind=JobKind.INSTANCE_STOP)


def _open_restart(client, qnode) -> Job:
    instance = instance_running_via_api(client, qnode.node)
    assert client.post(f"{URL}{instance.pk}/restart/").status_code == 202
    return Job.objects.get(instance=instance, kind=JobKind.INSTANCE_RESTART)


def _open_start(client, qnode) -> Job:
    instance = _stopped(client, qnode)
    assert client.post(f"{URL}{instance.pk}/start/").status_code == 202
    return Job.objects.get(instance=instance, kind=JobKind.INSTANCE_START)


def _open_provision(client, qnode) -> Job:
    answer = client.post(URL, {"offer": qnode.node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                               "ssh_public_key": ed25519_key()}, format="json")
    assert answer.status_code == 201, answer.content
    return Job.objects.get(instance_id=answer.json()["id"], kind=JobKind.INSTANCE_PROVISION)


def _open_destroy(client, qnode) -> Job:
    instance = _stopped(client, qnode)
    assert client.delete(f"{URL}{instance.pk}/").status_code == 202
    return Job.objects.get(instance=instance, kind=JobKind.INSTANCE_DESTROY)


def _open_volume_create(client, qnode) -> Job:
    answer = client.post(VOLUMES, {"offer": qnode.node.pk, "size_gb": 1}, format="json")
    assert answer.status_code == 201, answer.content
    return Job.objects.get(volume_id=answer.json()["id"], kind=JobKind.VOLUME_CREATE)


def _open_volume_delete(client, qnode) -> Job:
    job = _open_volume_create(client, qnode)
    deliver(tasks.volume_create, job)
    volume = Volume.objects.get(pk=job.volume_id)
    assert volume.state == VolumeState.AVAILABLE, volume.status_message
    answer = client.delete(f"{VOLUMES}{volume.pk}/", {"confirm": volume.name}, format="json")
    assert answer.status_code == 202, answer.content
    return Job.objects.get(volume=volume, kind=JobKind.VOLUME_DELETE)


OPENERS = {JobKind.INSTANCE_STOP: _open_stop, JobKind.INSTANCE_RESTART: _open_restart,
           JobKind.INSTANCE_START: _open_start, JobKind.INSTANCE_PROVISION: _open_provision,
           JobKind.INSTANCE_DESTROY: _open_destroy, JobKind.VOLUME_CREATE: _open_volume_create,
           JobKind.VOLUME_DELETE: _open_volume_delete}


def _deliver(job: Job) -> Job:
    deliver_until_closed(TASKS[job.kind], job)
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED, (job.status, job.error)
    assert "host key" in job.error, job.error
    return job


@pytest.mark.parametrize("kind", list(OPENERS))
def test_a_job_opened_before_the_quarantine_that_meets_the_same_key_counts_nothing_again(qnode, client_for, kind):
    client = client_for(funded_renter())
    job = OPENERS[kind](client, qnode)  # queued, not yet run by a worker
    qnode.quarantined_by_a_health_check()
    before = _figures(qnode)
    assert before[0] == 1

    job = _deliver(job)
    # critical events, jobs held against the node, failed jobs its reliability counts: as the quarantine left them
    assert _figures(qnode) == before, (kind, job.fault, job.error)
    assert job.fault == JobFault.HOST_KEY and "does not count against the node" in job.error
    node = qnode.fresh()
    assert node.seen_host_key_fingerprint and node.state == "quarantined"


def test_two_jobs_opened_before_the_quarantine_add_nothing_after_the_first_quarantine(qnode, client_for):
    client = client_for(funded_renter())
    jobs = [_open_stop(client, qnode), _open_volume_create(client, qnode)]
    qnode.quarantined_by_a_health_check()
    before = _figures(qnode)
    for job in jobs:
        _deliver(job)
    assert _figures(qnode) == before


def test_a_start_that_met_the_changed_key_says_it_can_be_started_once_the_key_is_accepted(qnode, client_for):
    client = client_for(funded_renter())
    job = _open_start(client, qnode)
    qnode.quarantined_by_a_health_check()
    _deliver(job)

    instance = Instance.objects.get(pk=job.instance_id)
    assert instance.status == InstanceStatus.STOPPED, instance.status_message
    message = instance.status_message
    assert "start it again" not in message, message
    assert "quarantined" in message and "host key" in message and "once the key is accepted" in message, message
    # What it says holds: a start is refused now.
    assert client.post(f"{URL}{instance.pk}/start/").status_code == 409


# ------------------------------------------------------------------------- new information is still recorded

def test_a_third_key_is_new_and_is_recorded_and_counted(qnode, client_for):
    client = client_for(funded_renter())
    job = _open_stop(client, qnode)
    first = qnode.quarantined_by_a_health_check().seen_host_key_fingerprint
    events, held, counted = _figures(qnode)
    qnode.change_host_key()  # reinstalled again: neither the pinned key nor the one the quarantine recorded

    job = _deliver(job)
    node = qnode.fresh()
    assert node.seen_host_key_fingerprint not in (first, node.host_key_fingerprint)
    assert _figures(qnode) == (events + 1, held + 1, counted + 1)
    assert job.fault == JobFault.NODE


def test_the_job_that_meets_the_change_first_quarantines_the_node_and_counts_once(qnode, client_for):
    client = client_for(funded_renter())
    job = _open_stop(client, qnode)
    qnode.change_host_key()  # no health check ran: the job is first to meet it

    job = _deliver(job)
    assert qnode.fresh().state == "quarantined"
    assert _figures(qnode) == (1, 1, 1)
    assert job.fault == JobFault.NODE
