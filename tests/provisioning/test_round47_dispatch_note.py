"""The dispatcher's note on a job it sends again ("sent again: no sign of life from <worker> since ...") was written
after the send, and only while the job was as the dispatcher had read it: a worker that claimed the job at once (its
runner changed) made the note vanish. The clean-clone CI run of round 47 found a taken-over job without it
(tests/e2e/test_instances.py::test_a_worker_killed_whole_mid_provisioning_is_noticed_and_another_worker_finishes).
The note is now written before the send."""
from datetime import timedelta

from django.utils import timezone

from provisioning.models import Job, JobKind
from provisioning.services import jobs as job_svc
from provisioning.services import maintenance
from provisioning.services.runner import job_begin
from tests.factories import make_node


def _ago(seconds: float):
    return timezone.now() - timedelta(seconds=seconds)


def _lost_job() -> Job:
    job = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())
    Job.objects.filter(pk=job.pk).update(sent_at=_ago(400), send_attempts=1, created_at=_ago(500))
    job_begin(job_id=job.pk, task_id="job-x", worker="dead@host")
    Job.objects.filter(pk=job.pk).update(heartbeat_at=_ago(300))
    return job


def test_a_job_taken_over_at_once_keeps_the_dispatchers_note(db, broker, monkeypatch):
    job = _lost_job()

    def send_and_claim_at_once(task_name, *, job_id, task_id, producer=None):
        broker(task_name, job_id=job_id, task_id=task_id, producer=producer)
        job_begin(job_id=job_id, task_id=task_id, worker="survivor@host")  # a worker as fast as the broker

    monkeypatch.setattr(job_svc, "_publish", send_and_claim_at_once)
    assert maintenance.jobs_dispatch()["recovered"] == 1
    job.refresh_from_db()
    assert "survivor@host" in job.runner and job.lost_runs == 1
    notes = [line["message"] for line in job.log if "no sign of life" in line["message"]]
    assert notes == [notes[0]] and "dead@host" in notes[0], job.log


def test_a_send_the_broker_refuses_says_so_after_the_note(db, broker, monkeypatch):
    job = _lost_job()

    def refuse(task_name, *, job_id, task_id, producer=None):
        raise ConnectionError("broker down")

    monkeypatch.setattr(job_svc, "_publish", refuse)
    assert maintenance.jobs_dispatch()["send_failed"] == 1
    job.refresh_from_db()
    assert [line["message"].split(":")[0] for line in job.log[-2:]] == ["sent again", "not sent after all"]
