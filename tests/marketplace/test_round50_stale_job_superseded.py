"""A renter's verb refused (409 "still under way") because of an earlier job of the same kind that had done its work
and was only left open (its worker lost after recording the node's answer, before closing the job), with a later job
of the instance since, so that the old one speaks for nothing (found by review): the renter could not stop a billed
instance, and the zero-balance stop skipped it, until the dispatcher or the reaper came by. Such a job is now closed
as superseded and the new one queued; an open job of the kind with no later job still refuses, as before."""
import pytest
from django.utils import timezone

from billing.services.enforcement import balances_enforce
from marketplace.models import Instance
from marketplace.services import instances as svc
from provisioning.models import Job, JobKind, JobStatus
from provisioning.services.jobs import SUPERSEDED
from tests.billing.helpers import fund, worker_done
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401

pytestmark = pytest.mark.django_db


def _stopped_with_its_stop_job_left_open_then_running_again(api) -> tuple[Instance, Job]:
    node = make_listed_node(gpu_count=2)
    instance = run(book(api.user, node))
    worker_done(instance)
    assert api.post(f"/api/v1/instances/{instance.pk}/stop/").status_code == 202
    svc.instance_mark_stopped(instance_id=instance.pk)
    stale = Job.objects.get(instance_id=instance.pk, kind=JobKind.INSTANCE_STOP)
    Job.objects.filter(pk=stale.pk).update(status=JobStatus.RUNNING)  # the worker died holding it
    assert api.post(f"/api/v1/instances/{instance.pk}/start/").status_code == 202
    svc.instance_mark_running(instance_id=instance.pk, ssh_host="10.0.0.1", ssh_port=40001, ssh_user="root")
    Job.objects.filter(instance_id=instance.pk, kind=JobKind.INSTANCE_START).update(
        status=JobStatus.SUCCEEDED, finished_at=timezone.now())
    return instance, stale


def test_stop_is_not_refused_by_a_superseded_stop_job_left_open(api):
    fund(api.user, "100")
    instance, stale = _stopped_with_its_stop_job_left_open_then_running_again(api)
    r = api.post(f"/api/v1/instances/{instance.pk}/stop/")
    assert r.status_code == 202, r.json()
    assert Instance.objects.get(pk=instance.pk).status == "stopping"
    stale.refresh_from_db()
    assert stale.status == JobStatus.SUCCEEDED and any(SUPERSEDED in line["message"] for line in stale.log)
    assert Job.objects.filter(instance_id=instance.pk, kind=JobKind.INSTANCE_STOP, id__gt=stale.pk,
                              status=JobStatus.QUEUED).count() == 1


def test_zero_balance_stop_is_not_skipped_by_a_superseded_stop_job_left_open(api, settings):
    settings.BILLING_REQUIRE_FUNDS = False  # a renter at zero balance with a running instance
    instance, _ = _stopped_with_its_stop_job_left_open_then_running_again(api)
    result = balances_enforce()
    assert Instance.objects.get(pk=instance.pk).status == "stopping", result


def test_an_open_job_of_the_kind_with_no_later_job_still_refuses(api):
    fund(api.user, "100")
    node = make_listed_node(gpu_count=2)
    instance = run(book(api.user, node))
    worker_done(instance)
    assert api.post(f"/api/v1/instances/{instance.pk}/stop/").status_code == 202
    # The stop is under way (its job open, the latest of the instance): a restart is refused by state, a second stop
    # is the documented no-op; the open stop job is neither closed nor doubled.
    assert api.post(f"/api/v1/instances/{instance.pk}/stop/").status_code == 202
    jobs = Job.objects.filter(instance_id=instance.pk, kind=JobKind.INSTANCE_STOP)
    assert jobs.count() == 1 and jobs.get().status in (JobStatus.QUEUED, JobStatus.RUNNING)
