"""Celery's soft time limit in a real worker (tests/live.py): the job's task sent with a short soft limit of its own,
as billiard enforces it in the pool process. Whose failure the job is follows who was being waited for when the
time ran out (provisioning.services.faults): the platform's own SSH sessions for the node (the platform's), or a
node that took the connection and said nothing (the node's)."""
import pytest
from django.core.cache import cache

from marketplace.models import Instance, InstanceStatus
from provisioning import tasks
from provisioning.concurrency import MAX_SESSIONS_PER_NODE
from provisioning.models import Job, JobFault, JobKind, JobStatus
from tests.factories import UserFactory
from tests.live import wait_until
from tests.marketplace.renting_helpers import book

from .test_job_fault import checked_node, reliability, silent_node

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def unsent(monkeypatch):
    """The booking's job is not handed to the worker on commit: each test sends it itself, with its time limit."""
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)


def provision_with_soft_limit(node, soft_s: float) -> tuple[Instance, Job]:
    instance = book(UserFactory(), node)
    job = instance.jobs.get(kind=JobKind.INSTANCE_PROVISION)
    tasks.instance_provision.apply_async((job.pk,), task_id=f"job-{job.pk}-soft", soft_time_limit=soft_s,
                                         time_limit=60)
    wait_until(lambda: Job.objects.get(pk=job.pk).status == JobStatus.FAILED, 45, what="the job to fail")
    return instance, Job.objects.get(pk=job.pk)


def test_a_worker_whose_time_ran_out_waiting_for_the_platforms_own_sessions_does_not_blame_the_node(worker):
    node = checked_node()
    for slot in range(MAX_SESSIONS_PER_NODE):  # the platform's other work holds them all (a minute's wait)
        assert cache.add(f"node-ssh-slot:{node.pk}:{slot}", "another-worker", timeout=120)
    instance, job = provision_with_soft_limit(node, 2)
    assert job.fault == JobFault.PLATFORM, job.error
    assert "ran past its time limit (2" in job.error and "SSH sessions it allows per node" in job.error
    assert "does not count against the node" in job.error
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.FAILED
    assert reliability(node) == 1.0


def test_a_worker_whose_time_ran_out_waiting_for_a_silent_node_blames_the_node(worker):
    with silent_node() as port:
        node = checked_node(address="127.0.0.1", ssh_port=port)
        instance, job = provision_with_soft_limit(node, 2)
    assert job.fault == JobFault.NODE, job.error
    assert "waited for the node's answer: the node answered too slowly" in job.error
    assert reliability(node) == pytest.approx(0.98)
