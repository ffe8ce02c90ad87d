"""The periodic jobs that keep the fleet honest: sending jobs (the outbox's dispatcher), reaping stuck jobs,
retrying pending verifications, and re-checking active nodes at random times (full verifications, and spot
checks of their idle GPUs). Health checks and reconciling VMs with the database run in batches:
provisioning.services.fleet (re-exported here).

Each runs as a singleton (a PostgreSQL advisory lock, core.locks), since beat may fire again before a slow
run ends.
"""
from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, TypedDict

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import transaction
from django.db.models import Exists, F, OuterRef, Prefetch, Q, Subquery
from django.utils import timezone

from core.errors import Conflict
from marketplace.models import Instance, InstanceStatus, Node, NodeState, Verdict
from marketplace.services import instances as instance_svc
from marketplace.services.nodes import node_in_use
from provisioning.models import OPEN_JOB_STATUSES, Job, JobFault, JobKind, JobStatus, NodeEvent
from provisioning.services.faults import PlatformError
from provisioning.services.fleet import (  # noqa: F401 (re-exported: the fleet's periodic jobs)
    HEALTH_PARALLELISM,
    Summary,
    nodes_health_check,
    nodes_health_dispatch,
    nodes_probe,
    nodes_reconcile,
    nodes_reconcile_dispatch,
    singleton,
)
from provisioning.services.jobs import JobConflict, job_alive, job_send
from provisioning.services.nodes import node_event
from provisioning.services.reconcile import node_reconcile  # noqa: F401 (re-exported)
from provisioning.services.runner import MAX_LOG_LINES, job_finish, log_lines
from provisioning.services.spot_checks import node_spot_check_request
from provisioning.services.verification import (
    draw_delay,
    draw_spot_gap,
    node_verify_failed,
    node_verify_request,
)
from provisioning.services.vms import WAITING_ON, vm_failed
from provisioning.services.volumes import volume_job_failed

if TYPE_CHECKING:
    from django_stubs_ext import WithAnnotations

log = logging.getLogger(__name__)

# Pending nodes' verifications are retried on their own after 1, 2, 3 failures in a row, this long after the
# last one; after PENDING_RETRY_MAX_FAILURES in a row the platform stops and tells the provider.
PENDING_RETRY_BACKOFF = (timedelta(minutes=10), timedelta(minutes=30), timedelta(hours=2))
PENDING_RETRY_MAX_FAILURES = 4
PENDING_RETRY_BATCH = 200  # pending nodes looked at per beat (nodes_verify_pending), the longest waiting first
PENDING_RETRY_REASON = "automatic retry"  # how such a job is marked in its log ("queued: automatic retry ...")


# Jobs sent per dispatcher run at most; the next run takes the rest.
DISPATCH_BATCH = 500
# The longest a queued job waits between two sends (the resend backoff's ceiling), and the doublings before it.
RESEND_BACKOFF_MAX = timedelta(hours=1)
RESEND_BACKOFF_DOUBLINGS = 6


def resend_backoff(send_attempts: int) -> timedelta:
    """How long after its last send a job sent but never started is sent again: JOB_RESEND_QUEUED_AFTER_S after
    the first send, then twice as long after each send (1, 2, 4 ... times), at most RESEND_BACKOFF_MAX, but never
    sooner than JOB_RESEND_QUEUED_AFTER_S (a setting above the ceiling: the rule before the backoff moved into SQL)."""
    doublings = min(max(send_attempts - 1, 0), RESEND_BACKOFF_DOUBLINGS)
    base = timedelta(seconds=settings.JOB_RESEND_QUEUED_AFTER_S)
    return max(base, min(base * (1 << doublings), RESEND_BACKOFF_MAX))


def _resend_due(now: datetime) -> Q:
    """Queued jobs sent before whose backoff (resend_backoff) is over, as a filter: one term per count of sends,
    the last for every count past the doublings. Jobs still waiting never reach the dispatcher's LIMIT."""
    last = RESEND_BACKOFF_DOUBLINGS + 1  # from this many sends on, the backoff no longer grows
    due = Q(send_attempts__gte=last, sent_at__lte=now - resend_backoff(last))
    for attempts in range(last):
        due |= Q(send_attempts=attempts, sent_at__lte=now - resend_backoff(attempts))
    return Q(status=JobStatus.QUEUED, sent_at__isnull=False) & due


def jobs_dispatch(*, now: datetime | None = None, limit: int = DISPATCH_BATCH) -> Summary:
    """The outbox's sender (one run at a time): hand to the broker the open jobs, before their deadline, that

    - were never sent (the broker was down when they were committed, or the process died first), once
      JOB_SEND_GRACE_S has passed (the on-commit send's moment);
    - are running, but the execution holding them stopped beating for JOB_HEARTBEAT_STALE_S (its worker was
      killed, ran out of memory, lost its machine), or a retry did not come that long after it was due: sent
      again, so that another worker takes it over (runner.job_begin), at most once per JOB_HEARTBEAT_STALE_S;
    - were sent but never started: the broker may have lost the message (a Redis restarted without its data).
      Again after JOB_RESEND_QUEUED_AFTER_S, then twice as long after each send, at most an hour apart
      (resend_backoff: a long queue only waits).

    Lost workers' jobs first (few, and their renters wait on them), then those never sent, then the resends;
    oldest first in each, at most `limit` in all. The backoff is part of the query, so a run only
    reads jobs it sends: jobs sitting out their backoff after a burst or an outage cannot fill the batch, and
    resends cannot crowd out a job never sent or a lost worker's job (every job read is sent and leaves the set).

    A copy too many is harmless: one execution at a time holds a job. The first send the broker refuses ends the
    run (it is down: the next run tries again), so an outage costs one failed send per run, not one per job."""
    with singleton("jobs_dispatch", ttl=60) as acquired:
        if not acquired:
            return {"skipped": "another dispatcher is running"}
        now = now or timezone.now()
        stale = now - timedelta(seconds=settings.JOB_HEARTBEAT_STALE_S)
        unsent = Q(status=JobStatus.QUEUED, sent_at__isnull=True,
                   created_at__lte=now - timedelta(seconds=settings.JOB_SEND_GRACE_S))
        lost = Q(status=JobStatus.RUNNING, heartbeat_at__lt=stale) & (Q(sent_at__isnull=True) | Q(sent_at__lt=stale))
        batch: list[tuple[str, Job]] = []
        for outcome, due in (("recovered", lost), ("sent", unsent), ("resent", _resend_due(now))):
            if len(batch) >= limit:
                break
            jobs = (Job.objects.filter(due, deadline__gt=now).order_by("created_at", "id")
                    .only("pk", "kind", "status", "sent_at", "send_attempts", "heartbeat_at", "runner", "log")
                    [:limit - len(batch)])
            batch += [(outcome, job) for job in jobs]
        summary = {"sent": 0, "resent": 0, "recovered": 0, "send_failed": 0}
        for outcome, job in batch:
            # The note before the send: once sent, a worker may claim the job (its runner changes) before the note
            # is written, and the note (written only while the job is as the dispatcher read it) was lost: the
            # clean-clone CI run of round 47 found a taken-over job without its "no sign of life" line.
            if outcome != "sent":
                _dispatch_note(job, now)
            if not job_send(job_id=job.pk, kind=job.kind):
                if outcome != "sent":
                    _dispatch_note(job, now, "not sent after all: the broker did not take it, the next pass tries")
                summary["send_failed"] += 1
                break
            summary[outcome] += 1
        return summary


def _dispatch_note(job: Job, now: datetime, message: str = "") -> None:
    """Say in the job's log why it is sent again (operators read it beside the steps), or `message`."""
    if not message and job.status == JobStatus.RUNNING:
        since = f"{job.heartbeat_at:%H:%M:%S} UTC" if job.heartbeat_at else "never"
        message = f"sent again: no sign of life from {job.runner or 'its retry'} since {since}"
    elif not message:
        assert job.sent_at is not None  # queued and sent before: only such a job is sent *again*
        message = f"sent again: not started {int((now - job.sent_at).total_seconds())} s after it was sent"
    log.info("job %s: %s", job.pk, message)
    line = {"at": now.isoformat(), "message": message}
    job.log = [*log_lines(job.log), line][-MAX_LOG_LINES:]
    # Unless a worker claimed it meanwhile: its own lines come first.
    Job.objects.filter(pk=job.pk, status=job.status, runner=job.runner).update(log=job.log)


def jobs_reap() -> Summary:
    """Fail jobs still open past their deadline, releasing what they held.

    A job whose execution still beats (its heartbeat younger than JOB_HEARTBEAT_STALE_S: jobs.job_alive) is left
    to it: it may be creating a VM on the GPUs the reaper would free for the next renter, and it ends by itself
    (its task's time limit, then the task's own failure handler, which cleans up on the node). A deadline counts
    from the job's creation, so a job that waited in a busy queue can pass it while it runs. An instance job ends as its
    task's own failure would (vms.vm_failed), without asking the node: a worker lost after the VM came up leaves
    the instance where the job brought it, a start goes back to stopped, and GPUs the VM may still use stay
    held until the node confirms it stopped or gone.

    A reaped job is the platform's failure, never the node's (JobFault): no execution of it is alive, so it was
    never started (no worker took it), its worker was lost, or the retry it waited for never came. A node that
    failed it would have failed it through its task.

    Each job is reaped in its own savepoint: one that raises is logged, counted ("errors") and tried again next
    run, and the jobs after it (older: newest first) are reaped all the same.
    """
    now = timezone.now()
    reaped = errors = 0
    for job in (Job.objects.filter(status__in=OPEN_JOB_STATUSES, deadline__lt=now).exclude(job_alive(now))
                .select_related("node")):
        try:
            with transaction.atomic():  # a failed job's writes go back alone (a savepoint inside a transaction)
                _job_reap(job)
        except SoftTimeLimitExceeded:
            raise  # the task's time is up: not this job's trouble (it was swallowed, the loop ran to the hard kill)
        except Exception:  # one job's trouble must not keep the others (older ones: read newest first) open
            log.exception("reap: job %s", job.pk)
            errors += 1
        else:
            reaped += 1
    return {"reaped": reaped, "errors": errors} if errors else {"reaped": reaped}


def _job_reap(job: Job) -> None:
    """End one job past its deadline (jobs_reap) as its task's own failure would."""
    error = PlatformError("The job did not finish in time and was stopped by the platform.")
    if job.kind == JobKind.NODE_VERIFY:
        node_verify_failed(job=job, error=error)
    elif job.volume_id is not None:
        volume_job_failed(job=job, error=error)
    else:
        # Only the instance's latest job speaks for it: an old stuck job must not fail an
        # instance that a later job has already brought back.
        newer = job.instance_id is not None and Job.objects.filter(instance_id=job.instance_id,
                                                                   id__gt=job.pk).exists()
        destroying = job.kind == JobKind.INSTANCE_DESTROY and job.instance_id is not None and (
            Instance.objects.filter(pk=job.instance_id, status=InstanceStatus.DESTROYING).exists())
        if job.instance_id and not newer and destroying:
            # The renter asked for the end: it ends for them, and the GPUs stay held until the
            # reconciler has removed the VM (as a destroy that could not reach the node).
            instance_svc.instance_mark_destroyed(instance_id=job.instance_id, cleanup_pending=True)
        elif job.instance_id and not newer and job.kind in WAITING_ON:
            vm_failed(job=job, error=error.message, fault=JobFault.PLATFORM, reach_node=False)
            return
        job_finish(job=job, error=error.message, fault=JobFault.PLATFORM)


def nodes_verify_pending(*, now: datetime | None = None) -> Summary:
    """Retry verification of pending nodes now and then (the provider may have installed the key since), backing
    off after each failure in a row (PENDING_RETRY_BACKOFF) and stopping after PENDING_RETRY_MAX_FAILURES, with
    a word to the provider: a node whose benchmark hangs must not hold a worker every ten minutes forever.

    The count comes from the node's jobs: the failed verifications since the last success or the last one that
    was asked for (by the provider's Verify, an operator, a re-verification), that one included. So asking again
    by hand (POST /api/v1/nodes/{id}/verify/) starts a new series of automatic retries."""
    with singleton("nodes_verify_pending", ttl=600) as acquired:
        if not acquired:
            return {"skipped": "another run is retrying pending verifications"}
        now = now or timezone.now()
        told = NodeEvent.objects.filter(node=OuterRef("pk"), kind="verification_retries_stopped")
        last = Job.objects.filter(node=OuterRef("pk"), kind=JobKind.NODE_VERIFY).order_by("-created_at", "-id")
        # Not the nodes whose retries stopped and were told so, with no verification asked since (nothing to do
        # for them until their provider asks): walked every beat, by pk, thousands of them pushed newer pending
        # nodes past the task's time limit (review r54). The rest the longest waiting first, PENDING_RETRY_BATCH a
        # beat: those past it come at the next beats.
        nodes = Node.objects.filter(state=NodeState.PENDING).annotate(
            told_at=Subquery(told.order_by("-created_at").values("created_at")[:1]),
            last_verify_at=Subquery(last.values("created_at")[:1]),
        ).exclude(told_at__isnull=False, last_verify_at__isnull=False, told_at__gte=F("last_verify_at")).order_by(
            F("last_verify_at").asc(nulls_first=True), "pk",
        ).prefetch_related(Prefetch(
            "jobs", to_attr="recent_verifications",
            queryset=Job.objects.filter(kind=JobKind.NODE_VERIFY).order_by("-created_at", "-id")
            [:PENDING_RETRY_MAX_FAILURES],
        ))[:PENDING_RETRY_BATCH]
        summary = {"queued": 0, "waiting": 0, "stopped": 0, "errors": 0}
        for node in nodes:
            try:
                summary[_node_verify_retry(node, now)] += 1
            except SoftTimeLimitExceeded:
                raise  # the task's time is up (review r54): the singleton's lock is let go, not held to its ttl
            except Exception:  # one node's trouble must not keep the others waiting
                log.exception("verify-pending: node %s", node.pk)
                summary["errors"] += 1
        return summary


def _automatic(job: Job) -> bool:
    return any(str(line.get("message", "")).startswith(f"queued: {PENDING_RETRY_REASON}")
               for line in log_lines(job.log)[:3])


def _failures_in_a_row(jobs: list[Job]) -> int:
    """Failed verifications, newest first, back to a success or to the first one not queued by this loop. Only
    the node's failures count (Job.fault): the platform's own (busy, lost, its own error) say nothing the provider
    could fix on the server, and neither stop the retries nor break the series."""
    failures = 0
    for job in jobs:
        if job.status != JobStatus.FAILED:
            break
        failures += job.fault == JobFault.NODE
        if not _automatic(job):
            break
    return failures


class _PendingNode(TypedDict):
    told_at: datetime | None  # when the provider was last told that the retries stopped
    recent_verifications: list[Job]  # newest first, PENDING_RETRY_MAX_FAILURES at most


def _node_verify_retry(node: WithAnnotations[Node, _PendingNode], now: datetime) -> str:
    """Queue the pending node's next automatic verification if it is due; say what was done."""
    jobs = node.recent_verifications
    if jobs and jobs[0].status in OPEN_JOB_STATUSES:
        return "waiting"
    failures = _failures_in_a_row(jobs)
    if failures >= PENDING_RETRY_MAX_FAILURES:
        last = jobs[0]
        if node.told_at is None or node.told_at < last.created_at:
            message = (
                f"Verification failed {failures} times in a row, so the platform stopped retrying it on its own. "
                f"The last attempt said: {last.error.strip() or 'no reason given.'} "
                "Fix that on the server, then ask for a verification again (Verify on the node's page, or "
                f"POST /api/v1/nodes/{node.pk}/verify/)."
            )
            # Only while still pending: the provider may have asked for a verification meanwhile.
            if Node.objects.filter(pk=node.pk, state=NodeState.PENDING).update(last_error=message,
                                                                               updated_at=timezone.now()):
                node_event(node=node, kind="verification_retries_stopped",
                           message=message, level=NodeEvent.Level.WARNING)
        return "stopped"
    if jobs:
        wait = PENDING_RETRY_BACKOFF[min(max(failures, 1), len(PENDING_RETRY_BACKOFF)) - 1]
        if (jobs[0].finished_at or jobs[0].created_at) + wait > now:
            return "waiting"
    node_verify_request(node=node,
                        reason=f"{PENDING_RETRY_REASON} (try {failures + 1} of {PENDING_RETRY_MAX_FAILURES})")
    return "queued"


# ------------------------------------------------------------------------------------ re-verification

def nodes_reverify_due(*, now: datetime | None = None) -> Summary:
    """The beat (every REVERIFY_BEAT_S): for each active node, queue

    - a full verification when its drawn time (Node.next_check_at, drawn with `secrets` when its last
      verification ended: verification.node_draw_next_checks) has come, or when it was rejected while rented and
      its renters have all left (so it leaves the active state);
    - else a spot check of its idle GPUs when its drawn spot-check time has come (drawn again at once, so a spot
      check that cannot run is not retried every beat).

    Nothing is queued while a node job is open (a spot check and a verification never run at once). A node with
    no drawn time (verified before this rule) gets one drawn from its last verification: a fleet upgraded at once
    does not come due at once."""
    with singleton("nodes_reverify_due", ttl=600) as acquired:
        if not acquired:
            return {"skipped": "another run is queueing re-verifications"}
        now = now or timezone.now()
        busy = Job.objects.filter(node=OuterRef("pk"), instance__isnull=True, volume__isnull=True,
                                  status__in=OPEN_JOB_STATUSES)
        last = Job.objects.filter(node=OuterRef("pk"), kind=JobKind.NODE_VERIFY).order_by("-created_at")
        due = (Q(next_check_at__isnull=True) | Q(next_check_at__lte=now) | Q(next_spot_check_at__isnull=True)
               | Q(next_spot_check_at__lte=now) | Q(verdict=Verdict.REJECTED))
        nodes = (Node.objects.filter(due, state=NodeState.ACTIVE).exclude(Exists(busy))
                 .annotate(last_verify_at=Subquery(last.values("created_at")[:1])).order_by("pk"))
        summary = {"queued": 0, "spot_checks": 0, "waiting": 0, "errors": 0}
        for node in nodes:
            try:
                with transaction.atomic():  # a failed node's writes go back alone
                    summary[_node_recheck(node, now)] += 1
            except Conflict as exc:  # e.g. retired between the query and its row lock: the others go on
                log.info("reverify-due: node %s: %s", node.pk, exc)
                summary["waiting"] += 1
            except SoftTimeLimitExceeded:
                raise  # the task's time is up (review r54): the singleton's lock is let go, not held to its ttl
            except Exception:  # one node's trouble must not keep the others (higher pks) from their checks
                log.exception("reverify-due: node %s", node.pk)
                summary["errors"] += 1
        if not summary["errors"]:
            del summary["errors"]
        return summary


def _node_recheck(node: WithAnnotations[Node, _LastVerify], now: datetime) -> str:
    """Queue what is due for this active node; say what was done ("queued", "spot_checks", "waiting"). Run in a
    transaction (nodes_reverify_due): the node's row is locked and its state read again first, so a node its
    provider put into maintenance since the query is left there, its checks due (a verification takes a node out
    of maintenance: review r54). The next spot check is drawn only once one is queued: one that could not be
    stays due, for the beat after the node is active again."""
    if node.next_check_at is None and node.last_verify_at is not None:
        node.next_check_at = node.last_verify_at + draw_delay(settings.REVERIFY_MIN_S, settings.REVERIFY_MAX_S)
        Node.objects.filter(pk=node.pk, next_check_at__isnull=True).update(next_check_at=node.next_check_at)
    if not Node.objects.select_for_update(no_key=True).filter(pk=node.pk, state=NodeState.ACTIVE).exists():
        return "waiting"
    due = node.next_check_at is None or now >= node.next_check_at
    # The conclusion's own rule (verification.node_verify_conclude): a rejected node stays active while it is in
    # use, a VM still to clean up or a GPU still held included; re-checked before, it would be rejected again,
    # stay active, and be benchmarked anew every beat until the cleanup ended (found by review).
    left = node.verdict == Verdict.REJECTED and not node_in_use(node_id=node.pk)
    try:
        with transaction.atomic():
            if due or left:
                node_verify_request(node=node, reason="scheduled re-verification" if due else "its renters left")
                return "queued"
            if node.verdict == Verdict.REJECTED:
                return "waiting"  # rented, and already judged: nothing to spot-check
            if node.next_spot_check_at is None:  # its first: drawn, not run (verified before spot checks were)
                next_at = now + draw_spot_gap()
                Node.objects.filter(pk=node.pk).update(next_spot_check_at=next_at)
            elif now >= node.next_spot_check_at and node_spot_check_request(node=node) is not None:
                next_at = now + draw_spot_gap()
                Node.objects.filter(pk=node.pk).update(next_spot_check_at=next_at)
                return "spot_checks"
    except JobConflict:  # a node job was queued since the query: next beat
        pass
    return "waiting"


class _LastVerify(TypedDict):
    last_verify_at: datetime | None  # when its latest verification was queued
