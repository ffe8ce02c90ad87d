"""A job's stored log (Job.log) of an odd shape: jsonb keeps any (a row fixed by hand, a data migration, an older
version), and what reads it must not break on it. Before, a log that was no list (a number, a bool, JSON null, a
string, an object) was a TypeError in runner._log_line (the job could never be claimed), in the reaper (which
stopped there, every run, so no older job was ever reaped: instances stuck provisioning with their GPUs held), in
the dispatcher's note (its run cut short) and on the admin's job page (a 500); one line that was no object hid
the whole log on that page. Now all read it through runner.log_lines, and the reaper guards each job."""
from datetime import timedelta
from unittest import mock

import pytest
from django.db.models import JSONField, Value
from django.utils import timezone

from provisioning.models import Job, JobKind, JobStatus
from provisioning.services import maintenance
from provisioning.services.jobs import job_create
from provisioning.services.runner import job_begin, job_finish, job_step, log_lines
from tests.factories import UserFactory, make_listed_node
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

LINE = {"at": "2026-01-01T00:00:00+00:00", "message": "connecting to the node"}
# Stored logs of odd shapes: no list at all, or a list with lines that are no objects.
NO_LIST = [5, True, Value("null", JSONField()), "some text", {"at": "x", "message": "y"}]
ODD_LINES = [[LINE, "odd"], [LINE, 3, None, [1, 2]]]


def _node_job(**fields):
    job = job_create(kind=JobKind.NODE_SPOT_CHECK, node=make_listed_node(gpu_count=1))
    Job.objects.filter(pk=job.pk).update(**fields)
    return job


def _clean(log) -> bool:
    return isinstance(log, list) and all(isinstance(line, dict) and "message" in line for line in log)


@pytest.mark.parametrize("log", NO_LIST + ODD_LINES)
def test_a_job_with_an_odd_log_is_claimed_stepped_and_finished_and_its_log_written_clean(log):
    job = _node_job(log=log)
    claimed = job_begin(job_id=job.pk, task_id="t1", worker="w")
    assert claimed is not None
    job_step(job=claimed, message="checking")
    job_finish(job=claimed)
    stored = Job.objects.get(pk=job.pk)
    assert stored.status == JobStatus.SUCCEEDED and _clean(stored.log)
    assert [line["message"] for line in stored.log][-2:] == ["checking", "done"]
    if isinstance(log, list):  # the real lines are kept, an odd one as its text
        assert stored.log[0] == LINE and len(stored.log) == len(log) + 3


def test_a_job_whose_log_is_no_list_does_not_stop_the_reaper_for_every_other_job():
    past = timezone.now() - timedelta(seconds=1)
    other = _node_job(deadline=past)  # older: the reaper reads newest first
    broken = _node_job(log=5, deadline=past)
    assert maintenance.jobs_reap() == {"reaped": 2}
    assert Job.objects.get(pk=other.pk).status == JobStatus.FAILED
    assert Job.objects.get(pk=broken.pk).status == JobStatus.FAILED and _clean(Job.objects.get(pk=broken.pk).log)


def test_one_job_the_reaper_cannot_end_does_not_keep_the_older_ones_open():
    past = timezone.now() - timedelta(seconds=1)
    older = _node_job(deadline=past)
    troubled = _node_job(deadline=past)
    real_finish = maintenance.job_finish

    def finish(*, job, **kwargs):
        if job.pk == troubled.pk:
            Job.objects.filter(pk=job.pk).update(step="half-written")  # goes back with its savepoint
            raise RuntimeError("boom")
        real_finish(job=job, **kwargs)

    with mock.patch.object(maintenance, "job_finish", side_effect=finish):
        assert maintenance.jobs_reap() == {"reaped": 1, "errors": 1}
    assert Job.objects.get(pk=older.pk).status == JobStatus.FAILED
    troubled = Job.objects.get(pk=troubled.pk)
    assert troubled.status == JobStatus.QUEUED and troubled.step != "half-written"  # tried again next run
    assert maintenance.jobs_reap() == {"reaped": 1}


def test_a_job_whose_log_is_no_list_does_not_stop_the_dispatcher_for_the_others(settings):
    stale = timezone.now() - timedelta(seconds=settings.JOB_HEARTBEAT_STALE_S + 5)
    broken = _node_job(log=5, status=JobStatus.RUNNING, runner="t w", heartbeat_at=stale, sent_at=stale,
                       send_attempts=1)
    other = _node_job(status=JobStatus.RUNNING, runner="t2 w", heartbeat_at=stale, sent_at=stale, send_attempts=1)
    with mock.patch("provisioning.services.jobs._publish"):
        assert maintenance.jobs_dispatch()["recovered"] == 2
    assert Job.objects.get(pk=other.pk).send_attempts == 2
    log = Job.objects.get(pk=broken.pk).log
    assert _clean(log) and log[-1]["message"].startswith("sent again")


@pytest.mark.parametrize("log", [5, True, None, "text", {"message": "queued: automatic retry"}])
def test_a_verification_whose_log_is_no_list_is_not_an_automatic_retry(log):
    assert maintenance._automatic(Job(log=log)) is False


def test_an_automatic_retry_is_still_told_apart_past_an_odd_line():
    assert maintenance._automatic(Job(log=["odd", {"message": "queued: automatic retry (try 2 of 4)"}])) is True


@pytest.mark.parametrize("log", NO_LIST)
def test_the_admin_job_page_survives_a_log_that_is_no_list(log):
    job = _node_job(log=log)
    ops = logged_in(UserFactory(is_staff=True, is_superuser=True))
    ops.raise_request_exception = False
    assert ops.get(f"/admin/provisioning/job/{job.pk}/change/").status_code == 200


@pytest.mark.parametrize("log", ODD_LINES)
def test_one_odd_line_does_not_hide_the_whole_log_on_the_admin_page(log):
    job = _node_job(log=log)
    ops = logged_in(UserFactory(is_staff=True, is_superuser=True))
    page = ops.get(f"/admin/provisioning/job/{job.pk}/change/").content.decode()
    assert "connecting to the node" in page and str(log[1]) in page  # the odd line shown as its text


def test_the_reader_keeps_object_lines_and_shows_the_others_as_text():
    assert log_lines([LINE, "odd", 7]) == [LINE, {"at": None, "message": "odd"}, {"at": None, "message": "7"}]
    assert log_lines(5) == log_lines(None) == log_lines("text") == log_lines({"a": 1}) == []
    assert log_lines(["x" * 900])[0]["message"] == "x" * 500


@pytest.mark.parametrize("log", [5, "some text", {"at": "x", "message": "y"}])
def test_a_vm_job_whose_log_is_no_list_counts_as_having_touched_the_vm(log):
    """vms._touched_vm did len() on the stored log: a provision job with log=5 past its deadline raised in
    vm_failed at every reaper run, its instance left provisioning with its GPUs held. A log of another shape tells
    nothing of what the job did, so the VM counts as touched (its failure waits for the node's confirmation)."""
    from provisioning.services import vms
    job = _node_job(log=log)
    assert vms._touched_vm(job) is True
    Job.objects.filter(pk=job.pk).update(log=[LINE])
    assert vms._touched_vm(job) is False
