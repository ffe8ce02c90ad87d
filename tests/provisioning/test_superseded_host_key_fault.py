"""A job that met its node's changed host key again (nodes.HostKeyStillChanged: fault host_key, counted once by the
quarantine) and a later job of its instance (vms._closed_as_superseded). Suspected: the later job turns the key's
failure into the platform's (`later` other than a destroy), or drops it. Not so, and pinned here: a job meets the
node only while its instance waits on it (provisioning, starting, stopping, destroying; one superseded when it
begins never connects), and from those states the renter's verbs (and the platform's) queue no job but a destroy
(stop and restart act from running, start from stopped: marketplace.models.renting), so the only later job a failing
job can find is a destroy, for which its own fault is kept. The quarantine itself is written when the session meets
the key (nodes.node_quarantine, under the node's lock), before any job's failure is labelled."""

import pytest
from django.utils import timezone

from core.errors import Conflict
from marketplace.models import Instance, InstanceStatus
from marketplace.services import instances as svc
from provisioning.models import OPEN, Job, JobFault, JobKind, JobStatus
from provisioning.services import vms
from provisioning.services.faults import error_fault
from provisioning.services.nodes import HostKeyStillChanged
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.renting_helpers import book, run

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def sent_jobs(monkeypatch):
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: None)


def _stopping() -> tuple[Instance, Job]:
    instance = run(book(UserFactory(), make_listed_node(gpu_count=1)))
    Job.objects.filter(OPEN, instance=instance).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    svc.instance_stop(instance=Instance.objects.get(pk=instance.pk))
    return Instance.objects.get(pk=instance.pk), Job.objects.get(OPEN, instance=instance, kind=JobKind.INSTANCE_STOP)


def test_while_a_job_is_under_way_only_a_destroy_can_come_after_it():
    instance, job = _stopping()
    for verb in ("start", "restart", "stop"):
        try:
            getattr(svc, f"instance_{verb}")(instance=Instance.objects.get(pk=instance.pk))
        except Conflict:
            pass  # refused; asked again while stopping, nothing changes (no second job)
    assert not Job.objects.filter(instance=instance, id__gt=job.pk).exists()


def test_a_host_key_failure_superseded_by_the_renters_destroy_keeps_its_label():
    instance, job = _stopping()
    svc.instance_destroy(instance=Instance.objects.get(pk=instance.pk))
    assert set(Job.objects.filter(instance=instance, id__gt=job.pk).values_list("kind", flat=True)) == {
        JobKind.INSTANCE_DESTROY
    }
    met = HostKeyStillChanged("SHA256:old", "SHA256:new")
    vms.vm_failed(job=job, error=met.message, fault=error_fault(met))
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED and job.fault == JobFault.HOST_KEY, (job.fault, job.error)
    assert vms.SUPERSEDED in job.error and "platform's failure" not in job.error
    assert Instance.objects.get(pk=instance.pk).status == InstanceStatus.DESTROYING
