"""Jobs are rows first: the outbox (a job committed with its state change is the truth; sending it is tried on
commit, and the dispatcher sends what was never sent, lost by the broker, or held by a lost worker) and the claim
that lets one execution at a time hold a job, with heartbeats. The real broker going down and a worker killed
mid-job are in tests/e2e/test_broker_outage.py and tests/e2e/test_instances.py."""
import time
from datetime import timedelta

import pytest
from celery import current_app
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from django.utils import timezone

from marketplace.models import GpuAllocation, InstanceStatus, NodeState
from provisioning import tasks
from provisioning.models import Job, JobFault, JobKind, JobStatus
from provisioning.services import jobs as job_svc
from provisioning.services import maintenance
from provisioning.services.runner import JobHeartbeat, JobLost, job_begin, job_finish, job_release, job_step
from provisioning.ssh_errors import NodeError
from tests.factories import make_listed_node, make_node


def public_key() -> str:
    return ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def ago(seconds: float):
    return timezone.now() - timedelta(seconds=seconds)


# ------------------------------------------------------------------------------------------- the registry


def test_every_job_kind_has_one_task_registered_under_its_name_and_a_runner():
    current_app.loader.import_default_modules()
    assert set(job_svc.JOB_TASKS) == set(JobKind) == set(tasks.RUNNERS) == set(job_svc.JOB_DEADLINES)
    for kind, name in job_svc.JOB_TASKS.items():
        task = current_app.tasks[name]
        assert task.acks_late and task.reject_on_worker_lost, kind
        assert task.__module__ == "provisioning.tasks", kind
    assert "provisioning.tasks.jobs_dispatch" in current_app.tasks


def test_the_dispatcher_runs_every_few_seconds_from_beat(settings):
    entry = settings.CELERY_BEAT_SCHEDULE["jobs-dispatch"]
    assert entry["task"] == "provisioning.tasks.jobs_dispatch" and entry["schedule"] <= 15
    assert settings.JOB_HEARTBEAT_INTERVAL_S * 3 < settings.JOB_HEARTBEAT_STALE_S <= 50
    # Redis must not hand a running job's message to a second worker while its task may still run.
    assert settings.BROKER_VISIBILITY_TIMEOUT_S > 2 * settings.CELERY_TASK_TIME_LIMIT
    assert settings.CELERY_BROKER_TRANSPORT_OPTIONS["visibility_timeout"] == settings.BROKER_VISIBILITY_TIMEOUT_S


# ------------------------------------------------------------------------------- sending: the broker down


def test_with_the_broker_down_the_api_answers_as_usual_and_the_jobs_wait_in_their_rows(transactional_db, broker,
                                                                                       api, other_api):
    """Booking and Verify commit their rows and answer JSON (201, 202), not a 500; the failure to send is on the
    job's row. Asking to verify again returns the same job and tries to send it again."""
    broker.down = True
    listed = make_listed_node()
    r = other_api.post("/api/v1/instances/", {"offer": listed.pk, "num_gpus": 1, "image": "cuda-12-4",
                                              "ssh_public_key": public_key()}, format="json")
    assert r.status_code == 201, r.content
    assert r["Content-Type"] == "application/json"
    instance_id = r.json()["id"]
    pending = make_node(api.user)
    r = api.post(f"/api/v1/nodes/{pending.pk}/verify/")
    assert r.status_code == 202 and r["Content-Type"] == "application/json", r.content

    provision = Job.objects.get(instance_id=instance_id)
    verify = Job.objects.get(node=pending, kind=JobKind.NODE_VERIFY)
    for job in (provision, verify):
        assert job.status == JobStatus.QUEUED and job.sent_at is None and job.send_attempts == 1
        assert job.send_error.startswith("OperationalError: Error 111")
    assert provision.instance.status == InstanceStatus.REQUESTED
    assert GpuAllocation.objects.filter(instance_id=instance_id, released_at__isnull=True).count() == 1
    pending.refresh_from_db()
    assert pending.state == NodeState.VERIFYING

    assert api.post(f"/api/v1/nodes/{pending.pk}/verify/").status_code == 202
    assert Job.objects.filter(node=pending, kind=JobKind.NODE_VERIFY).count() == 1
    verify.refresh_from_db()
    assert verify.send_attempts == 2 and verify.sent_at is None  # tried again at once, the broker still down

    # The dispatcher stops at the first refusal: one failed send per run, however many jobs wait.
    later = timezone.now() + timedelta(seconds=30)
    assert maintenance.jobs_dispatch(now=later)["send_failed"] == 1
    assert broker.messages == []

    broker.down = False
    summary = maintenance.jobs_dispatch(now=later)
    assert summary["sent"] == 2 and summary["send_failed"] == 0
    assert sorted(broker.job_ids()) == sorted([provision.pk, verify.pk])
    names = {job_id: name for name, job_id, _ in broker.messages}
    assert names == {provision.pk: "provisioning.tasks.instance_provision", verify.pk: "provisioning.tasks.node_verify"}
    for job in (provision, verify):
        job.refresh_from_db()
        assert job.sent_at is not None and job.send_error == ""
    # Sent: the next run leaves them alone.
    assert maintenance.jobs_dispatch(now=later)["sent"] == 0 and len(broker.messages) == 2


def test_a_job_is_sent_on_commit_and_each_send_has_its_own_task_id(transactional_db, broker, api):
    node = make_node(api.user)
    assert api.post(f"/api/v1/nodes/{node.pk}/verify/").status_code == 202
    [(name, job_id, task_id)] = broker.messages
    job = Job.objects.get(pk=job_id)
    assert name == "provisioning.tasks.node_verify" and task_id.startswith(f"job-{job.pk}-")
    assert job.sent_at is not None and job.send_attempts == 1 and job.send_error == ""
    assert job_svc.job_send(job_id=job.pk)
    assert broker.messages[1][2] != task_id


def test_a_never_sent_job_waits_for_the_on_commit_send_before_the_dispatcher_takes_it(db, broker, settings):
    settings.JOB_SEND_GRACE_S = 5
    job = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())  # in the test's transaction: not sent
    assert maintenance.jobs_dispatch()["sent"] == 0
    assert maintenance.jobs_dispatch(now=timezone.now() + timedelta(seconds=6))["sent"] == 1
    assert broker.job_ids() == [job.pk]


def test_a_job_past_its_deadline_is_left_to_the_reaper(db, broker):
    job = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())
    Job.objects.filter(pk=job.pk).update(deadline=ago(1), created_at=ago(60))
    assert maintenance.jobs_dispatch()["sent"] == 0 and broker.messages == []


def test_a_job_sent_but_never_started_is_sent_again_with_backoff(db, broker, settings):
    """The broker lost the message (a Redis restarted without its data): sent again, less often each time."""
    settings.JOB_RESEND_QUEUED_AFTER_S = 120
    job = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())
    Job.objects.filter(pk=job.pk).update(sent_at=ago(100), send_attempts=1, created_at=ago(100))
    assert maintenance.jobs_dispatch()["resent"] == 0
    Job.objects.filter(pk=job.pk).update(sent_at=ago(130))
    assert maintenance.jobs_dispatch()["resent"] == 1
    job.refresh_from_db()
    assert job.send_attempts == 2 and "not started 130 s after it was sent" in job.log[-1]["message"]
    Job.objects.filter(pk=job.pk).update(sent_at=ago(130))  # the second time: 240 s
    assert maintenance.jobs_dispatch() == {"sent": 0, "resent": 0, "recovered": 0, "send_failed": 0}
    Job.objects.filter(pk=job.pk).update(sent_at=ago(250))
    assert maintenance.jobs_dispatch()["resent"] == 1


def test_the_backoff_is_in_the_query_the_same_as_resend_backoff(db, broker, settings):
    """Each count of sends waits resend_backoff(count) after the last send: a job is sent again just past it,
    not just before it."""
    settings.JOB_RESEND_QUEUED_AFTER_S = 120
    assert [maintenance.resend_backoff(n).total_seconds() for n in range(1, 10)] == [
        120, 240, 480, 960, 1920, 3600, 3600, 3600, 3600]
    for attempts in range(0, 10):
        backoff = maintenance.resend_backoff(attempts).total_seconds()
        job = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())
        Job.objects.filter(pk=job.pk).update(sent_at=ago(backoff - 5), send_attempts=attempts, created_at=ago(4000))
        assert maintenance.jobs_dispatch()["resent"] == 0, attempts
        Job.objects.filter(pk=job.pk).update(sent_at=ago(backoff + 5))
        assert maintenance.jobs_dispatch()["resent"] == 1, attempts
        Job.objects.filter(pk=job.pk).update(status=JobStatus.SUCCEEDED, finished_at=timezone.now())


def test_a_resend_setting_above_the_ceiling_is_still_waited(db, broker, settings):
    """JOB_RESEND_QUEUED_AFTER_S over an hour: each resend waits the setting, not the hour's ceiling (the rule
    before the backoff moved into the query; found by the second review round)."""
    settings.JOB_RESEND_QUEUED_AFTER_S = 7200
    assert {maintenance.resend_backoff(n).total_seconds() for n in range(0, 10)} == {7200}
    job = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())
    Job.objects.filter(pk=job.pk).update(sent_at=ago(3700), send_attempts=1, created_at=ago(4000))
    assert maintenance.jobs_dispatch()["resent"] == 0
    Job.objects.filter(pk=job.pk).update(sent_at=ago(7205))
    assert maintenance.jobs_dispatch()["resent"] == 1


def test_a_lost_workers_job_is_recovered_before_a_backlog_of_jobs_never_sent(db, broker):
    """A broker outage leaves thousands of jobs never sent; a job a dead worker holds (a renter waits on it) goes
    first, as it did when the run took the oldest of all (found by the second review round)."""
    lost = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())
    Job.objects.filter(pk=lost.pk).update(sent_at=ago(400), send_attempts=1, created_at=ago(500))
    job_begin(job_id=lost.pk, task_id="job-x", worker="dead@host")
    Job.objects.filter(pk=lost.pk).update(heartbeat_at=ago(300))
    for _ in range(2):
        unsent = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())
        Job.objects.filter(pk=unsent.pk).update(created_at=ago(60))
    assert maintenance.jobs_dispatch(limit=2) == {"sent": 1, "resent": 0, "recovered": 1, "send_failed": 0}
    assert lost.pk in broker.job_ids()


def test_a_backlog_of_jobs_in_their_backoff_does_not_starve_lost_and_never_sent_jobs(db, broker, settings):
    """Found by review: the dispatcher took the oldest `limit` jobs and only then skipped those still in their
    backoff, so after a burst or a broker outage older jobs waiting out their backoff filled every run
    ({"waiting": 500} every 10 s), and a job never sent or held by a dead worker waited for the reaper.
    limit=2 stands for DISPATCH_BATCH."""
    settings.JOB_RESEND_QUEUED_AFTER_S = 120
    backlog = []
    for _ in range(2):  # older jobs, resent once, in their 240 s backoff (a queue backlog)
        job = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())
        Job.objects.filter(pk=job.pk).update(sent_at=ago(200), send_attempts=2, created_at=ago(600))
        backlog.append(job.pk)
    lost = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())  # its worker died 5 min ago
    Job.objects.filter(pk=lost.pk).update(sent_at=ago(400), send_attempts=1, created_at=ago(500))
    job_begin(job_id=lost.pk, task_id="job-x", worker="dead@host")
    Job.objects.filter(pk=lost.pk).update(heartbeat_at=ago(300))
    unsent = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())  # never handed over
    Job.objects.filter(pk=unsent.pk).update(created_at=ago(60))

    summary = maintenance.jobs_dispatch(limit=2)
    assert summary == {"sent": 1, "resent": 0, "recovered": 1, "send_failed": 0}
    assert sorted(broker.job_ids()) == sorted([lost.pk, unsent.pk])
    assert maintenance.jobs_dispatch(limit=2) == {"sent": 0, "resent": 0, "recovered": 0, "send_failed": 0}

    # Resends due come after those, within the same limit.
    Job.objects.filter(pk__in=backlog).update(sent_at=ago(250))
    again = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())
    Job.objects.filter(pk=again.pk).update(created_at=ago(60))
    assert maintenance.jobs_dispatch(limit=2) == {"sent": 1, "resent": 1, "recovered": 0, "send_failed": 0}
    assert maintenance.jobs_dispatch(limit=2) == {"sent": 0, "resent": 1, "recovered": 0, "send_failed": 0}
    assert sorted(broker.job_ids()[2:]) == sorted([again.pk, *backlog])


def test_the_dispatcher_runs_one_at_a_time(db, broker):
    with maintenance.singleton("jobs_dispatch", ttl=60) as acquired:
        assert acquired
        assert "skipped" in maintenance.jobs_dispatch()


# --------------------------------------------------------------------------- the claim and the heartbeat


def test_one_execution_at_a_time_holds_a_job(db, settings):
    settings.JOB_HEARTBEAT_STALE_S = 45
    job = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())
    first = job_begin(job_id=job.pk, task_id="job-1-a", worker="w1@host")
    assert first.runner.startswith("job-1-a w1@host:") and first.attempts == 1 and first.lost_runs == 0
    # Another copy of the job (the dispatcher's, or the broker's) while the first beats: it does nothing.
    assert job_begin(job_id=job.pk, task_id="job-1-b", worker="w2@host") is None
    # The same message delivered again: its execution died (reject_on_worker_lost); taken over at once.
    again = job_begin(job_id=job.pk, task_id="job-1-a", worker="w1@host")
    assert again.runner != first.runner and again.attempts == 2 and again.lost_runs == 1
    assert again.step.startswith("resumed: its execution was lost")
    # The lost execution, should it still run, changes nothing any more and stops at its next step.
    with pytest.raises(JobLost):
        job_step(job=first, message="benchmarking")
    job_finish(job=first, error="too late", fault=JobFault.PLATFORM)
    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING and job.runner == again.runner and job.error == ""
    # Its heartbeat stops: after JOB_HEARTBEAT_STALE_S another copy takes it over.
    Job.objects.filter(pk=job.pk).update(heartbeat_at=ago(46))
    third = job_begin(job_id=job.pk, task_id="job-1-c", worker="w2@host")
    assert third.lost_runs == 2 and "its worker stopped answering" in third.step
    job_finish(job=third)
    assert job_begin(job_id=job.pk, task_id="job-1-d") is None  # finished: nothing to run


def test_an_execution_whose_job_was_reaped_stops_at_its_next_step(db):
    job = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())
    begun = job_begin(job_id=job.pk, task_id="job-7-a")
    job_finish(job=Job.objects.get(pk=job.pk), error="The job did not finish in time and was stopped by the platform.",
               fault=JobFault.PLATFORM)
    with pytest.raises(JobLost):
        job_step(job=begun, message="judging the GPUs against the catalogue")
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED and job.step == "failed"


def test_a_job_waiting_for_its_retry_is_held_by_nobody_until_the_retry_is_due(db, broker, settings):
    settings.JOB_HEARTBEAT_STALE_S = 45
    job = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())
    Job.objects.filter(pk=job.pk).update(sent_at=ago(120), created_at=ago(120))
    begun = job_begin(job_id=job.pk, task_id="job-2-a")
    job_release(begun, retry_at=timezone.now() + timedelta(seconds=30))
    job.refresh_from_db()
    assert job.runner == "" and job.status == JobStatus.RUNNING
    # Not lost while the retry is due, nor for JOB_HEARTBEAT_STALE_S after.
    assert maintenance.jobs_dispatch(now=timezone.now() + timedelta(seconds=70))["recovered"] == 0
    # The retry itself (the same task id) claims it without counting a lost run.
    retried = job_begin(job_id=job.pk, task_id="job-2-a")
    assert retried.attempts == 2 and retried.lost_runs == 0 and retried.step == "started again (attempt 2)"


def test_a_running_job_whose_worker_stopped_beating_is_sent_again_once_per_stale_period(db, broker, settings):
    settings.JOB_HEARTBEAT_STALE_S = 45
    job = job_svc.job_create(kind=JobKind.INSTANCE_PROVISION, node=make_node())
    Job.objects.filter(pk=job.pk).update(sent_at=ago(300), send_attempts=1, created_at=ago(300))
    begun = job_begin(job_id=job.pk, task_id="job-3-a", worker="lost@host")
    assert maintenance.jobs_dispatch()["recovered"] == 0  # it beats
    Job.objects.filter(pk=job.pk).update(heartbeat_at=ago(50))
    assert maintenance.jobs_dispatch()["recovered"] == 1
    assert broker.job_ids() == [job.pk]
    job.refresh_from_db()
    assert job.send_attempts == 2 and f"no sign of life from {begun.runner}" in job.log[-1]["message"]
    # Sent again just now: not again until that copy had JOB_HEARTBEAT_STALE_S to be taken.
    assert maintenance.jobs_dispatch()["recovered"] == 0
    Job.objects.filter(pk=job.pk).update(sent_at=ago(50))
    assert maintenance.jobs_dispatch()["recovered"] == 1


@pytest.mark.django_db(transaction=True)
def test_the_heartbeat_beats_while_the_job_runs_and_stops_when_it_is_taken_over(broker):
    # `broker`: committed, the job would be sent, and the suite's live worker (tests/live.py) could take it first.
    job = job_svc.job_create(kind=JobKind.NODE_VERIFY, node=make_node())
    begun = job_begin(job_id=job.pk, task_id="job-4-a")
    start = begun.heartbeat_at
    with JobHeartbeat(begun, interval_s=0.05) as heartbeat:
        time.sleep(0.4)
        job.refresh_from_db()
        assert job.heartbeat_at > start
        Job.objects.filter(pk=job.pk).update(runner="someone else", heartbeat_at=start)
        time.sleep(0.3)
        assert not heartbeat._thread.is_alive()  # nothing left to vouch for
    job.refresh_from_db()
    assert job.heartbeat_at == start


class _Task:
    """What run_job reads of a Celery task: its request (id, worker) and retry budget."""

    max_retries = 3

    def __init__(self, task_id: str):
        self.request = type("Request", (), {"id": task_id, "hostname": "w@host", "retries": 0})()


def test_a_job_whose_worker_was_lost_too_often_fails_in_words(db, settings, broker):
    settings.JOB_MAX_LOST_RUNS = 3
    listed = make_listed_node()
    from marketplace.models import Image
    from marketplace.services import instances as instance_svc
    from tests.factories import UserFactory

    instance, _ = instance_svc.instance_create(renter=UserFactory(), node_id=listed.pk, num_gpus=1,
                                               image=Image.objects.filter(active=True).first(),
                                               ssh_public_keys=[public_key()])
    job = instance.jobs.get()
    Job.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING, runner="job-5-a w@h:1:x", heartbeat_at=ago(60),
                                         lost_runs=3)
    tasks.run_job(_Task("job-5-b"), job.pk)
    job.refresh_from_db()
    instance.refresh_from_db()
    assert job.status == JobStatus.FAILED and "lost 4 times" in job.error
    assert instance.status == InstanceStatus.FAILED
    assert not GpuAllocation.objects.filter(instance=instance, released_at__isnull=True).exists()


def test_an_execution_that_lost_its_job_does_not_fail_it(db, monkeypatch):
    """Taken over while it stalled, then its node call fails: the job and the instance are the new holder's."""
    listed = make_listed_node()
    from marketplace.models import Image
    from marketplace.services import instances as instance_svc
    from tests.factories import UserFactory

    instance, _ = instance_svc.instance_create(renter=UserFactory(), node_id=listed.pk, num_gpus=1,
                                               image=Image.objects.filter(active=True).first(),
                                               ssh_public_keys=[public_key()])
    job = instance.jobs.get()

    def stalled_then_failed(*, job):
        Job.objects.filter(pk=job.pk).update(runner="job-6-b w2@h:2:y")  # another worker took it over
        raise NodeError("The node did not answer.")

    monkeypatch.setitem(tasks.RUNNERS, JobKind.INSTANCE_PROVISION, (stalled_then_failed, None))
    tasks.run_job(_Task("job-6-a"), job.pk)
    job.refresh_from_db()
    instance.refresh_from_db()
    assert job.status == JobStatus.RUNNING and instance.status == InstanceStatus.REQUESTED


# ------------------------------------------------------------------ sending from the sender thread (production)


@pytest.fixture
def in_background(settings):
    """JOB_SEND_IN_BACKGROUND as in production with PostgreSQL; the thread is stopped (its connection closed)
    afterwards."""
    settings.JOB_SEND_IN_BACKGROUND = True
    yield job_svc.sender
    assert job_svc.sender.stop()


def test_in_the_background_a_booking_answers_first_and_its_job_is_sent_and_recorded_after(
        transactional_db, broker, in_background, other_api):
    listed = make_listed_node(gpu_count=4)
    ids = []
    for _ in range(3):
        r = other_api.post("/api/v1/instances/", {"offer": listed.pk, "num_gpus": 1, "image": "cuda-12-4",
                                                  "ssh_public_key": public_key()}, format="json")
        assert r.status_code == 201, r.content
        ids.append(r.json()["id"])
    assert in_background.flush(timeout=10)
    jobs = list(Job.objects.filter(instance_id__in=ids).order_by("pk"))
    assert sorted(broker.job_ids()) == [job.pk for job in jobs]
    for job in jobs:
        assert job.sent_at is not None and job.send_attempts == 1 and job.send_error == ""
    # Sent and recorded: the dispatcher leaves them alone.
    assert maintenance.jobs_dispatch(now=timezone.now() + timedelta(seconds=30))["sent"] == 0


def test_in_the_background_a_refused_batch_waits_in_its_rows_for_the_dispatcher(transactional_db, broker,
                                                                               in_background):
    """The first refusal ends the batch: the rest are recorded as refused, untried (the broker is down)."""
    broker.down = True
    nodes = [make_node() for _ in range(3)]
    jobs = [job_svc.job_create(kind=JobKind.NODE_VERIFY, node=n) for n in nodes]  # autocommit: sent at once
    assert in_background.flush(timeout=10)
    for job in jobs:
        job.refresh_from_db()
        assert job.sent_at is None and job.send_attempts == 1 and job.send_error.startswith("OperationalError")
    broker.down = False
    assert maintenance.jobs_dispatch(now=timezone.now() + timedelta(seconds=30))["sent"] == 3
    assert sorted(broker.job_ids()) == sorted(job.pk for job in jobs)


def test_the_sender_thread_hands_each_batch_over_and_a_forked_child_starts_empty():
    from core.background import BackgroundBatcher

    batches = []
    idle = []
    batcher = BackgroundBatcher("test", batches.append, idle_s=0.05, on_idle=lambda: idle.append(1))
    for n in range(5):
        batcher.submit(n)
    assert batcher.flush(timeout=5)
    assert sorted(x for b in batches for x in b) == [0, 1, 2, 3, 4]
    deadline = time.monotonic() + 5
    while not idle and time.monotonic() < deadline:
        time.sleep(0.01)
    assert idle  # idle after 50 ms: e.g. the thread's database connection closed
    assert batcher.stop(timeout=5)
    batcher._reset()  # what os.register_at_fork runs in a child: no thread, nothing queued
    assert batcher._thread is None and batcher.flush(timeout=0)
